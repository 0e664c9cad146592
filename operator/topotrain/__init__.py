"""topotrain: elastic, topology-aware distributed training on Kubernetes.

This package holds the operator and the pieces the bundled trainer shares with
it (``contract``, ``checkpoints``). Importing it pulls in no Kubernetes client.
"""

__version__ = "0.1.0"
GROUP = "topotrain.io"
VERSION = "v1alpha1"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
