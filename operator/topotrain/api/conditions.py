"""TrainingJob condition types and reasons, named constants (as JobSet and Kueue do).

`topotrain.api.status` re-exports both; the status models and `set_condition` live there.
"""

from __future__ import annotations


class ConditionType:
    SCHEDULABLE = "Schedulable"  # a placement exists for the gang
    READY = "Ready"  # every pod of the current attempt is Running
    PROGRESSING = "Progressing"  # the trainer reports progress within progressTimeoutSeconds
    RECOVERING = "Recovering"  # a restart is in flight
    CONFIG_VALID = "ConfigValid"  # references resolve (Secret, pools)
    STORE_REACHABLE = "CheckpointStoreReachable"  # the operator can read the checkpoint store
    PODS_CREATED = "PodsCreated"  # the API server accepted every pod of the current attempt
    SUSPENDED = "Suspended"  # spec.suspend: the gang is stopped (or stopping) and the job kept
    ADMITTED = "Admitted"  # Kueue admitted the job's Workload (only for a job sent to a Kueue queue)
    TRAINER_COOPERATION = "TrainerCooperation"  # what the trainer was seen doing of the contract
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class Reason:
    PLACED = "Placed"
    INSUFFICIENT_CAPACITY = "InsufficientCapacity"
    UNKNOWN_GPU_TYPE = "UnknownGPUType"
    TOPOLOGY_UNSATISFIABLE = "TopologyUnsatisfiable"
    SECRET_NOT_FOUND = "CheckpointSecretNotFound"
    SECRET_INVALID = "CheckpointSecretInvalid"
    SECRET_FORBIDDEN = "CheckpointSecretForbidden"
    ENDPOINT_NOT_ALLOWED = "CheckpointEndpointNotAllowed"  # outside the operator's allowlist
    CONFIG_OK = "ConfigResolved"
    INVALID_SPEC = "InvalidSpec"  # the spec does not parse (an object older than the CRD's schema)
    PODS_PENDING = "PodsPending"
    PODS_RUNNING = "PodsRunning"
    POD_FAILED = "PodFailed"
    POD_DELETED = "PodDeleted"
    POD_EVICTED = "PodEvicted"
    NODE_LOST = "NodeLost"
    NODE_NOT_READY = "NodeNotReady"
    NODE_CORDONED = "NodeCordoned"  # a node of the running gang was cordoned: the gang moves off it
    PROGRESS_STALLED = "ProgressStalled"
    PROGRESS_OK = "ProgressReported"
    BACKOFF = "BackoffWaiting"
    RESTARTED = "GangRestarted"
    RESTARTED_IN_PLACE = "RestartedInPlace"
    SHRUNK = "ShrunkDataParallel"
    GREW = "GrewDataParallel"
    RESIZED = "Resized"
    MAX_RESTARTS = "MaxRestartsExceeded"
    NON_RETRYABLE = "NonRetryableExitCode"
    FAILED_BY_RULE = "FailedByRule"  # a spec.failurePolicy.rules entry with action Fail matched
    DEADLINE_EXCEEDED = "DeadlineExceeded"  # spec.activeDeadlineSeconds passed
    TEMPLATE_NOT_FOUND = "TemplateNotFound"  # spec.templateRef names no TrainingJobTemplate
    TEMPLATE_INVALID = "TemplateMergeInvalid"  # the job's spec merged over its template is invalid
    TEMPLATE_RESOLVED = "TemplateResolved"  # status.jobTemplate took a (new) template generation
    COMPLETED = "AllPodsSucceeded"
    STORE_UNAVAILABLE = "CheckpointStoreUnavailable"
    STORE_OK = "CheckpointStoreAnswered"
    STORE_ERRORS = "CheckpointStoreErrors"  # reads failing for less than the grace: still reachable
    PODS_CREATED_OK = "AllPodsCreated"
    POD_CREATE_REFUSED = "PodCreateRefused"  # the API server refused a pod (PodSecurity, webhook, ...)
    QUOTA_EXCEEDED = "QuotaExceeded"  # a ResourceQuota refused a pod
    POD_SPEC_INVALID = "PodSpecInvalid"  # the API server found the pod invalid (422)
    PODS_NOT_STARTING = "PodsNotStarting"  # pods stuck (image pull, config, Unschedulable) too long
    POD_PREEMPTED = "PodPreempted"
    SPEC_CHANGED = "SpecChanged"
    MAX_INFRA_RESTARTS = "MaxInfrastructureRestartsExceeded"
    NODE_AVOIDED = "NodeAvoided"
    NODES_FORGIVEN = "NodesForgiven"
    FOREIGN_OBJECT = "ForeignObject"  # a child's name is taken by an object this job does not own
    FOREIGN_CHECKPOINTS = "ForeignCheckpoints"  # the checkpoint prefix holds another run's steps
    RESUMED_FOREIGN = "ResumedForeignCheckpoints"  # resumePolicy Always took another run's steps
    RESUMED_RUN = "ResumedRunFromElsewhere"  # a re-dispatched copy went on from its run's steps
    CHECKPOINT_REQUESTED = "CheckpointRequested"  # a planned change asked the gang for a checkpoint
    CHECKPOINT_SERVED = "CheckpointServed"  # ... and the trainer committed it
    CHECKPOINT_TIMED_OUT = "CheckpointRequestTimedOut"  # ... not in time: the last commit is used
    SUSPENDING = "Suspending"  # spec.suspend: waiting for the running gang's checkpoint
    SUSPENDED = "Suspended"  # spec.suspend: no pod runs
    RESUMED = "Resumed"  # spec.suspend back to false: the gang starts again
    # Kueue (a job with the kueue.x-k8s.io/queue-name label; core/kueue*.py, controller/queue_link.py)
    WAITING_FOR_ADMISSION = "WaitingForAdmission"  # Kueue has not admitted the Workload yet
    KUEUE_ADMITTED = "AdmittedByKueue"
    EVICTED = "EvictedByKueue"  # Kueue took the admission back (preempted, ...): the gang stops
    # A node of Kueue's topology assignment is lost and the gang does not fit on the rest: the
    # operator evicts the Workload (reason NodeFailures) so Kueue assigns the job anew
    HANDED_BACK = "HandedBackToKueue"
    # TrainerCooperation (core/cooperation.py): heartbeat, commits, requests, contract version
    TRAINER_COOPERATES = "TrainerCooperates"  # everything the operator counts on was seen
    TRAINER_PARTIAL = "TrainerCooperationPartial"  # something is missing: the message says what
    TRAINER_NOT_SEEN = "TrainerNotSeenYet"  # the gang has not run yet
    NO_CHECKPOINT_STORE = "NoCheckpointStore"  # no spec.checkpoint: no heartbeat, no commit
