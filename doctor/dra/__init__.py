"""hami-doctor for DRA drivers, one module per stage, as for device plugins.

`doctor.dra.evidence` reads the sidecar's DRA evidence once and the kubelet's DRA log lines
(part of `doctor.evidence`'s gathering); `doctor.dra.causes` judges the DRA rows from them
(part of `doctor.causes`'s diagnosis). Nothing is imported here, so that importing one stage
never imports the other.
"""
