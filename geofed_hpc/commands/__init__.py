"""What each `geofed-hpc` command does, given its typed config (cli.py parses the command line and composes the
config; nothing here imports Hydra)."""

from __future__ import annotations

from collections.abc import Callable

from geofed_hpc.commands.egress import cmd_relay
from geofed_hpc.commands.jobs import cmd_cancel, cmd_launch, cmd_logs, cmd_site_check, cmd_site_new, cmd_status
from geofed_hpc.commands.models import cmd_export_hf, cmd_generate, load_trained
from geofed_hpc.commands.options import OPTIONS
from geofed_hpc.commands.runs import cmd_data_prepare, cmd_report, cmd_wandb_sync
from geofed_hpc.commands.server import cmd_ps_init, cmd_ps_up, cmd_token_issue, cmd_token_list, cmd_token_revoke
from geofed_hpc.config import RunConfig

HANDLERS: dict[str, Callable[[RunConfig], int]] = {
    "launch": cmd_launch,
    "ps up": cmd_ps_up,
    "ps init": cmd_ps_init,
    "status": cmd_status,
    "cancel": cmd_cancel,
    "logs": cmd_logs,
    "report": cmd_report,
    "wandb sync": cmd_wandb_sync,
    "token issue": cmd_token_issue,
    "token revoke": cmd_token_revoke,
    "token list": cmd_token_list,
    "data prepare": cmd_data_prepare,
    "export hf": cmd_export_hf,
    "generate": cmd_generate,
    "site new": cmd_site_new,
    "site check": cmd_site_check,
    "relay": cmd_relay,
}
__all__ = ["HANDLERS", "OPTIONS", "load_trained"]
