"""What every stage may use: devices and dtypes (device), processes and ranks (distributed), the
host allocator (hostmem), files written safely and read without executing code (integrity), and
the run folder's lock (runlock). Imports no other e2v stage."""
