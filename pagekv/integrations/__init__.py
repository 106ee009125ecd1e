"""Integrations of pagekv into other inference stacks (each one an optional extra).

- :mod:`pagekv.integrations.transformers`: a Hugging Face ``Cache`` over pagekv pages and an
  attention function that runs pagekv's paged kernels (``pip install pagekv[transformers]``).
"""
