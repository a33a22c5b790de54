"""The deployment lifecycle behind one Backend interface: state records, the up skeleton, backends."""
