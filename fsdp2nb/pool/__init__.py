"""The kernel's handle on the ranks: spec, launcher, pool lifecycle, reaper. No torch."""
