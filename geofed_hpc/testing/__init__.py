"""Test harnesses that ship with the package: the emulated WAN (root only)."""
