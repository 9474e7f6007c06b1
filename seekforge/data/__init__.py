"""Training data: Megatron .bin/.idx files (indexed.py), `seekforge preprocess` (preprocess.py),
windows / shuffles / blends / resumable batches (dataset.py), built-in corpora (corpora.py)."""
