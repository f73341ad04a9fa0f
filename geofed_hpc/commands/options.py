"""The switches of one `geofed-hpc` invocation that only some commands read (cli.main sets them)."""

from __future__ import annotations

import argparse

# Switches of this invocation that only some commands read (main sets them).
OPTIONS = argparse.Namespace(
    dry_run=False,
    follow=False,
    ps_check=True,
    given=[],
    init_from="",
    ttl="",
    token_id="",
    site_given=False,
    paths=[],
    dtype="fp32",
    site="",
    force=False,
    prompt="",
    max_new_tokens=50,
    temperature=0.0,
    seed=0,
    model_given=False,
    # --demo: a Slurm site may train on the demo corpus (data.source=bible); the command it was given to
    demo=False,
    command="",
    # relay: where it forwards to and listens, how many connections at once, when an idle one is closed
    relay_to="",
    relay_listen="",
    relay_max_connections=256,
    relay_idle="10m",
    # relay --spool: the shared folder it serves, how often it looks there, --once (drain, then exit: cron)
    relay_spool="",
    relay_poll="200ms",
    relay_once=False,
)
