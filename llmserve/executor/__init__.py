"""The executor that drives the ranks of a tensor-parallel engine: rank 0's handle on its
workers (`executor.py`), the workers' loop (`worker.py`), and how they meet and talk
(`ranks.py`)."""
