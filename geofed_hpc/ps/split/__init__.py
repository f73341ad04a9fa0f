"""Split learning's server part beside the PS (paradigm fsl_sage or split): serving (service.py), snapshots."""
