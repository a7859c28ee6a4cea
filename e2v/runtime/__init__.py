"""What every stage may use: devices and dtypes (device), processes and ranks (distributed), the
host allocator (hostmem), files replaced in one step (files), checkpoints read without executing
code (integrity), and the run folder's lock (runlock). Imports no other e2v stage."""
