"""topotrain: elastic, topology-aware distributed training on Kubernetes.

At the top level sit only the modules the bundled trainer shares with the operator
(``contract``, ``checkpoints``, ``degrees``, ``s3client``: stdlib and boto3, importing
nothing else of the package). The operator is laid out by layer, each importing only those
below it: ``api`` (the TrainingJob models), ``placement`` (the gang planner), ``core`` (every
decision, pure), ``controller`` (kopf, the API client, the job loops) and ``cli``. The
import-linter contract in pyproject.toml enforces it. Importing this package pulls in no
Kubernetes client.
"""

__version__ = "0.1.0"
GROUP = "topotrain.io"
VERSION = "v1alpha1"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
TEMPLATE_KIND = "TrainingJobTemplate"
TEMPLATE_PLURAL = "trainingjobtemplates"
