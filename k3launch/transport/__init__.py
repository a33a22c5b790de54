"""Side effects, one seam: command runners (local, SSH), fleets of nodes, HTTP probes."""
