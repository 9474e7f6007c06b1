"""Debugging tools that hook into any `nn.Module` (seekforge's Transformer, a `transformers` model):

  dump.py     forward/backward hooks → per-module-call statistics (JSONL) or tensors (safetensors)
  compare.py  two dumps → per-call accuracy metrics, the first diverging module, CSV (+ a name mapping
              between implementations, mappings/*.yaml)
  report.py   the comparison as a self-contained HTML tree of the module hierarchy
  monitor.py  per-step activation/gradient/optimizer-state norms, expert loads, anomaly alerts
  trace.py    per-step phase timings as Prometheus metrics and on-demand torch.profiler traces
  training.py the above bundled for the pretraining loop (train/trainer.py calls it)

probe/ imports only config, model, parallel and data (the layer contract in pyproject.toml).
"""
