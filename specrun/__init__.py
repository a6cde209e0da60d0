"""specrun: lossless speculative decoding for ultra-long generations, run as resumable Ray jobs.

Packages: decoding (engine, no Ray, no files), storage (Parquet, atomic files), jobs (driver), actors (Ray).
"""

__version__ = "0.1.0"
