"""Test harnesses that ship with the package: the emulated WAN (root only) and scripted fault injection."""
