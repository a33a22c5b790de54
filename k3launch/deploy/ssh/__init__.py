"""The SSH/local backend: processes started over SSH (or on this machine), watched and stopped per node."""
