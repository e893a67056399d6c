"""DRA drivers: their evidence and rounds (`watch`, `slices`) and pure verdicts (`verdicts`)."""
