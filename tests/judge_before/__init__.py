"""The device-plugin judge as it was before its rules were split into rule-family modules.

`verdicts` is `sidecar/deviceplugin/verdicts.py` as it stood then, evidence types included, kept only as
the reference that tests/test_judge_differential.py drives in lockstep with the current judge. Delete
this package, and that test, at the next change of the judge's rules: from then on old and new differ
on purpose.
"""
