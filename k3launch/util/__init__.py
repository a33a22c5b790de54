"""Small helpers every layer may use: bundled files, file locks, deadline polling, host lists. No k3launch imports but errors."""
