"""`python -m hami_guard.profiles`: the profiles as JSON, the post-renderer's copy (make profiles)."""

import sys

from hami_guard.profiles import PROFILES, export

sys.stdout.write(export(PROFILES))
