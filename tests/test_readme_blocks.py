"""Every command of README.md's ```bash blocks, run in order as a user would type it, or named here with the reason it
cannot run on this machine: a README that drifts from the code fails `make test`.

Each block's commands run through bash, one line at a time, with the substitutions that map the README's world onto
this machine (`Shell.expand`):

- every host (`vm`, `vm.example.org`, `ps-east.example.org`, `ps-eu.example.org`, a cluster's login node) is this
  machine, each with a HOME of its own under the test's folder (the VM and the login node share one); `scp HOST:PATH`
  and `scp PATH HOST:DIR` copy from and to that HOME, `ssh HOST 'CMD'` runs CMD in it;
- the PS's port 50051 is a free loopback port, and its metrics port 9464 another; `ps up` runs in the background with
  `ps.host=127.0.0.1 ps.port=... ps.metrics_port=...` and the sites' cadence `train.sync_interval=2s` (the PS sets it);
- `TOKEN` is the token the block's own `token issue` line printed; `runs/<federation>` is the run directory the
  block's `launch` printed;
- `~/corpus` (and `corpus/*.jsonl.zst`, from HOME) is a small JSONL zstd corpus written here: the Bible's first
  4,000 verses, one document per chapter;
- `model=llama3_1b data.tokenizer=~/Llama-3.2-1B/tokenizer.json` (a 1B model does not train on 2 CPU cores) is
  `model=tiny` with its own GPT-2 tokenizer, one sync and two validation batches, and the PS's `model=llama3_1b` is
  `model=tiny`; `train.max_syncs=20` is 2 syncs of 2 s;
- `$EDITOR` on the user's `site/osc.yaml` writes the local test cluster's values into it (conf/site/slurm_local.yaml:
  its partition, no GPUs, no setup lines), one job, and `run_dir: $HOME/scratch/runs`.

Lines that need Slurm run against the local test cluster (slurm/, started here as root as tests/test_slurm.py does);
without one the others still run and the test ends skipped, naming the lines it could not run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
import zstandard

from tests.dist_util import free_pair

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BIN = Path(sys.executable).parent  # the virtualenv's bin: `geofed-hpc` and `python`

RUN = "run"  # run as written (after the substitutions)
PS_UP = "ps up"  # a `ps up`: in the background until the block ends
SLURM = "slurm"  # run, against the local test cluster
NOT_HERE = "not run here"  # with the reason
COVERED = "covered"  # run by another test, named in the reason

CORE = "the tests run in this checkout's .venv, which `make test` installs"


@dataclass(frozen=True)
class Line:
    """One README command (comments dropped, continuation lines joined, blanks collapsed) and how it is run."""

    text: str
    how: str = RUN
    why: str = ""  # NOT_HERE, COVERED: the reason
    on: str = "vm"  # the machine (its own HOME) it runs on
    expect: str = ""  # a string its output holds
    retry: bool = False  # run it again (for up to a minute) until the output holds `expect`
    subs: tuple[tuple[str, str], ...] = ()  # its own substitutions, before the block's


LAUNCH = "geofed-hpc launch site=osc ps=cloud ps.address=vm:50051 ps.ca_file=~/geofed/ca.crt site.token=TOKEN $RUN"
PEERS = "ps.peers=[ps-east.example.org:50051,ps-eu.example.org:50051]"
PS_GROUP = f"geofed-hpc ps up ps=cloud ps.peer_sync_interval=30s {PEERS} ps.peer_rank={{}} "
PS_GROUP += "ps.peer_secret_file=~/.geofed/peer.secret"
RUN_LLAMA = 'RUN="model=llama3_1b data.tokenizer=~/Llama-3.2-1B/tokenizer.json data.source=~/corpus"'


def bench(script: str, args: str, why: str) -> Line:
    return Line(f".venv/bin/python bench/{script}.py {args}", NOT_HERE, f"a benchmark, not a check: {why}")


PLANS: dict[str, list[Line]] = {
    "Two commands": [
        Line(
            "make demo",
            COVERED,
            "tests/test_local_federation.py::test_two_sites_lower_the_global_validation_loss_and_resume runs its "
            "launch (site=local model=tiny, two syncs of 2 s) and a resume",
        ),
        Line("make test", NOT_HERE, "the whole suite, this test among it"),
    ],
    "On real clusters": [
        Line("geofed-hpc ps init ps=cloud ps.tls_names=[vm.example.org]", expect="wrote"),
        Line("geofed-hpc ps up ps=cloud model=llama3_1b", PS_UP),
        Line("geofed-hpc token issue site=osc ps=cloud --ttl 30d", expect="gft_"),
        Line("geofed-hpc token list ps=cloud", expect="valid"),
        Line("geofed-hpc status ps=cloud ps.address=127.0.0.1:50051", expect="mode async"),
        Line("curl -s http://vm:9464/metrics | grep geofed_", expect="geofed_"),
        Line(RUN_LLAMA),
        Line(f"{LAUNCH} --dry-run", expect="(not submitted)"),
        Line(LAUNCH, SLURM, expect="submitted osc-0: job"),
        Line("geofed-hpc status site=osc", SLURM, expect="osc-0"),
        Line("geofed-hpc logs site=osc --follow", SLURM, expect="all jobs ended"),
        Line("geofed-hpc cancel site=osc", SLURM, expect="osc-0"),
        Line("geofed-hpc wandb sync runs/<federation>", NOT_HERE, "uploads to W&B: the network and a `wandb login`"),
        Line("geofed-hpc report runs/<federation>", SLURM, expect="wrote"),  # the run the Slurm launch made
        Line("geofed-hpc token revoke site=osc ps=cloud", expect="revoked token"),
    ],
    "Several parameter servers (a PS group, one per region)": [
        Line("geofed-hpc ps init ps=cloud ps.tls_names=[ps-east.example.org,ps-eu.example.org]", on="east"),
        Line("(umask 077 && openssl rand -hex 32 > ~/.geofed/peer.secret)", on="east"),
        Line("ssh ps-eu.example.org 'mkdir -p -m 700 .geofed/ps'", on="east"),
        Line("scp -p ~/.geofed/peer.secret ps-eu.example.org:.geofed/", on="east"),
        Line(
            "scp -p ~/.geofed/ps/ca.crt ~/.geofed/ps/server.crt ~/.geofed/ps/server.key ps-eu.example.org:.geofed/ps/",
            on="east",
        ),
        Line(PS_GROUP.format(0), PS_UP, on="east"),
        Line(PS_GROUP.format(1), PS_UP, on="eu"),
        Line("geofed-hpc status ps=cloud ps.address=127.0.0.1:50051", on="east", expect="2 of 2 peers", retry=True),
        # `...` stands for the launch settings shown above; the sites' failover between peers is run by
        # tests/test_ps_group_procs.py: here the lines are composed (`--cfg`) with the address lists as written
        Line(
            "geofed-hpc launch site=osc ps=cloud ps.address=[ps-east.example.org:50051,ps-eu.example.org:50051] ...",
            on="east",
            subs=(("...", "--cfg"),),
        ),
        Line(
            "geofed-hpc launch site=iitm ps=cloud ps.address=[ps-eu.example.org:50051,ps-east.example.org:50051] ...",
            on="east",
            subs=(("...", "--cfg"),),
        ),
    ],
    "On a cluster: from `git clone` to the first `launch`": [
        Line("cd $HOME && git clone https://github.com/ORG/geofed-hpc.git", NOT_HERE, f"the network (GitHub); {CORE}"),
        Line("module load python/3.12", NOT_HERE, "a cluster's environment modules (Lmod): none here"),
        Line("python -m venv $HOME/venvs/geofed && source $HOME/venvs/geofed/bin/activate"),
        Line("pip install --upgrade pip", NOT_HERE, f"the network (PyPI); {CORE}"),
        Line(
            "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126",
            NOT_HERE,
            f"the network (download.pytorch.org), a CUDA build; {CORE}",
        ),
        Line("pip install -e $HOME/geofed-hpc", NOT_HERE, f"the network (its dependencies from PyPI); {CORE}"),
        Line(
            'srun -p gpu --gpus=1 -t 5 python -c "import torch; print(torch.__version__, torch.cuda.is_available())"',
            NOT_HERE,
            "a cluster's GPU partition: the local test cluster has no GPU (tests/test_gpu.py checks CUDA)",
        ),
        Line("mkdir -p ~/geofed && scp vm.example.org:.geofed/ps/ca.crt ~/geofed/ca.crt"),
        Line("geofed-hpc site new osc", expect="wrote"),
        Line("$EDITOR ~/.config/geofed-hpc/site/osc.yaml"),
        Line('FED="ps=cloud ps.address=vm.example.org:50051 ps.ca_file=~/geofed/ca.crt site.token=TOKEN"'),
        Line(RUN_LLAMA),
        Line("geofed-hpc site check site=osc $FED $RUN", expect="site osc: ready to launch"),
        Line("geofed-hpc launch site=osc $FED $RUN --dry-run", expect="(not submitted)"),
        Line("geofed-hpc launch site=osc $FED $RUN", SLURM, expect="submitted osc-0: job"),
        Line("geofed-hpc status site=osc && geofed-hpc logs site=osc --follow", SLURM, expect="all jobs ended"),
    ],
    "Keeping state off the VM": [
        Line("pip install 'geofed-hpc[s3]'", NOT_HERE, f"the network (PyPI); {CORE}, the s3 extra with it"),
        Line("aws s3 mb s3://my-lab-geofed", NOT_HERE, "real AWS: an account and the network (no aws CLI here)"),
        Line(
            "geofed-hpc ps up ps=cloud model=llama3_1b ps.state_dir=s3://my-lab-geofed/run1",
            NOT_HERE,
            "real AWS; tests/test_object_store.py::test_ps_up_on_a_url_fails_over_to_a_new_machine_over_grpc runs "
            "`ps up` on an s3:// state_dir against moto's S3-protocol server, killed and taken over by a second one",
        ),
        Line(
            "AWS_ENDPOINT_URL=https://minio.example.org:9000 geofed-hpc ps up ps=cloud model=llama3_1b "
            "ps.state_dir=s3://geofed/run1",
            NOT_HERE,
            "a MinIO server on the network; tests/test_object_store.py reaches moto's server the same way, through "
            "AWS_ENDPOINT_URL",
        ),
        Line(
            "geofed-hpc launch site=osc model=llama3_1b train.checkpoint_mirror=s3://my-lab-geofed/run1-ckpt",
            NOT_HERE,
            "real AWS and a GPU cluster; tests/test_object_store_site.py::test_a_purged_site_resumes_from_its_mirror_"
            "bit_for_bit_reading_its_shards_from_the_bucket runs site jobs with train.checkpoint_mirror against moto",
        ),
        Line(
            "geofed-hpc data prepare data.source='s3://my-lab-geofed/corpus/*.jsonl.zst' "
            "data.shards_url=s3://my-lab-geofed/shards",
            NOT_HERE,
            "real AWS; tests/test_object_store_site.py::test_data_prepare_reads_a_corpus_from_the_bucket_and_sites_"
            "read_its_shards_there runs this `data prepare` against moto's server",
        ),
        Line(
            "geofed-hpc launch site=osc model=llama3_1b data.source=s3://my-lab-geofed/shards "
            "train.checkpoint_mirror=s3://my-lab-geofed/run1-ckpt",
            NOT_HERE,
            "real AWS and a GPU cluster; tests/test_object_store_site.py runs site jobs with an s3:// data.source "
            "(shards) and train.checkpoint_mirror against moto's server",
        ),
    ],
    "From a corpus to a Hugging Face model": [
        Line("geofed-hpc data prepare data.source='corpus/*.jsonl.zst' site.num_sites=2 run_dir=runs/fed"),
        Line(
            "geofed-hpc launch site=local model=tiny data.source=runs/fed/data run_dir=runs/fed train.max_syncs=20",
            expect="global validation loss",
            subs=(("train.max_syncs=20", "train.max_syncs=2 train.sync_interval=2s data.val_batches=2"),),
        ),
        Line('geofed-hpc generate runs/fed --prompt "In the beginning" --max-new-tokens 40', expect="In the beginning"),
        Line("geofed-hpc export hf runs/fed out/fed-model", expect="exported"),
        Line(
            "python -c \"from transformers import pipeline; print(pipeline('text-generation', 'out/fed-model')"
            "('In the')[0])\"",
            expect="generated_text",
        ),
    ],
    "Your own training loop": [
        Line("geofed-hpc ps up train.max_local_steps=20", PS_UP),
        Line(
            "python examples/torch_loop.py ps.address=127.0.0.1:50051 --site-index 0 & python examples/torch_loop.py "
            "ps.address=127.0.0.1:50051 --site-index 1 && wait $!",
            expect='"site": "local-1", "steps": 60',
            subs=(("examples/", f"{REPO}/examples/"), ("--site-index", "--steps=60 wandb_mode=disabled --site-index")),
        ),
        Line(
            "geofed-hpc launch site=local run_dir=runs/mine script=examples/torch_loop.py --steps 60",
            expect="run directory:",
            subs=(("examples/", f"{REPO}/examples/"), (" script=", " wandb_mode=disabled script=")),
        ),
    ],
    "Your own model": [
        Line(
            "geofed-hpc launch site=local model=hf model.path=~/models/Qwen2.5-0.5B model.context=256 run_dir=runs/own",
            expect="global validation loss",
            subs=(
                ("model.context=256", "model.context=32"),  # a tiny Qwen2 stands in for the 0.5B one (write_own_model)
                ("run_dir=runs/own", "run_dir=runs/own train.max_syncs=2 train.sync_interval=2s data.max_tokens=20000"),
            ),
        ),
        Line("geofed-hpc export hf runs/own out/own-model", expect="as a qwen2 model"),
        Line(
            'python -c "import transformers; '
            "print(transformers.AutoModelForCausalLM.from_pretrained('out/own-model'))\"",
            expect="Qwen2ForCausalLM",
        ),
    ],
    "Benchmarks (scripts, not tests; each writes JSON and prints a table against a same-run baseline)": [
        bench("codec", "--json bench/results/codec.json", "a ~30M-parameter model's delta through every codec"),
        bench("ps_scale", "--json bench/results/ps_scale.json", "up to 64 sites pushing (about 30 minutes)"),
        bench("wire", "--json bench/results/wire.json", "~25M-parameter transfers over gRPC"),
        bench("sparse_index", "--json docs/sparse_index.json", "about 2 minutes on 2 cores"),
        bench("compression", "--json docs/compression.json --png docs/compression.png", "about 25 minutes"),
        bench("rejoin", "--json bench/results/rejoin.json", "a 354M-parameter site killed and restarted"),
        bench("ckpt_load", "--json bench/results/ckpt_load.json", "5.4 GB checkpoints"),
        bench("paradigms", "--json bench/results/paradigms.json", "every paradigm for 5 rounds"),
        bench("data_prepare", "--json bench/results/data_prepare.json", "a 210 MB corpus, twice"),
        Line(
            "sudo .venv/bin/python bench/wan.py --json bench/results/wan.json",
            NOT_HERE,
            "a benchmark, not a check: root and network namespaces (tests/test_wan.py runs the emulated links)",
        ),
        Line(
            "sudo .venv/bin/python bench/egress.py --json bench/results/egress.json",
            NOT_HERE,
            "a benchmark, not a check: root, namespaces, squid (tests/test_egress_topology.py runs the paths)",
        ),
        Line(
            "sudo .venv/bin/python bench/goodput.py --json bench/results/goodput.json",
            NOT_HERE,
            "a benchmark, not a check: root, network namespaces and 8 federations of 3 sites (about 15 minutes)",
        ),
        bench("chaos", "--json bench/results/chaos.json --minutes 3", "3 minutes (tests/test_chaos_bench.py)"),
        bench("multi_ps", "--json bench/results/multi_ps.json", "a few minutes (tests/test_ps_group_procs.py)"),
        bench("swarm", "--json docs/swarm.json", "thousands of simulated sites, many minutes (tests/test_swarm.py)"),
        bench("ps_memory", "--json docs/ps_memory.json", "models of 560M and 1.2B parameters: 20+ GB of RAM"),
        bench("object_store", "--json bench/results/object_store.json", "a 1 GB snapshot (tests/test_object_store.py)"),
        bench("convergence", "--json docs/convergence.json --png docs/convergence.png", "about 15 minutes"),
    ],
}

TINY = "model=tiny train.max_syncs=1 data.val_batches=2"  # for a Slurm site of the local cluster
SUBS_CLUSTER = [
    ("model=llama3_1b data.tokenizer=~/Llama-3.2-1B/tokenizer.json", TINY),
    ("model=llama3_1b", "model=tiny"),  # the PS: the sites' model
    ("vm.example.org:50051", "127.0.0.1:{port}"),
    ("vm:50051", "127.0.0.1:{port}"),
    ("127.0.0.1:50051", "127.0.0.1:{port}"),
    ("http://vm:9464", "http://127.0.0.1:{metrics}"),
]


# ---------------------------------------------------------------- the README's blocks
def _uncomment(line: str) -> str:
    """`line` without its shell comment (a `#` that starts a word outside quotes)."""
    quote, before = "", " "
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and before.isspace():
            return line[:i].rstrip()
        before = ch
    return line.rstrip()


def readme_commands() -> dict[str, list[str]]:
    """The command lines of every ```bash block, under the heading above it, in order."""
    blocks: dict[str, list[str]] = {}
    heading, fence, pending = "", "", ""
    for raw in README.read_text().splitlines():
        if raw.startswith("```"):
            fence = "" if fence else (raw[3:].strip() or "text")
            if fence == "bash":
                blocks.setdefault(heading, [])
            continue
        if not fence and raw.startswith("#"):
            heading = raw.lstrip("#").strip()
        if fence != "bash":
            continue
        line = _uncomment(raw)
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = " ".join((pending + line).split()), ""
        if line:
            blocks[heading].append(line)
    return blocks


def plan_of(heading: str) -> list[Line]:
    """The plan of one block, checked against the README's commands under `heading`."""
    written, planned = readme_commands().get(heading), [line.text for line in PLANS[heading]]
    assert written == planned, _drift(heading, written or [], planned)
    return PLANS[heading]


def _drift(heading: str, written: list[str], planned: list[str]) -> str:
    new = [f"  README, neither run nor allow-listed here: {t}" for t in written if t not in planned]
    gone = [f"  planned here, no longer in the README: {t}" for t in planned if t not in written]
    order = [] if new or gone else ["  the same commands in another order"]
    return f"README block '{heading}' drifted from tests/test_readme_blocks.py PLANS:\n" + "\n".join(new + gone + order)


# ---------------------------------------------------------------- this machine as the README's hosts
def write_corpus(home: Path) -> None:
    """~/corpus/part-0.jsonl.zst: the Bible's first 4,000 verses, one document per chapter."""
    from geofed_hpc.data.sources import bible_path

    docs: dict[tuple[str, int], list[str]] = {}
    for raw in bible_path().read_text().splitlines()[:4000]:
        verse = json.loads(raw)
        docs.setdefault((verse["book"], verse["chapter"]), []).append(verse["text"])
    lines = "".join(json.dumps({"text": " ".join(v)}) + "\n" for v in docs.values())
    (home / "corpus").mkdir(parents=True)
    (home / "corpus" / "part-0.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))


def write_own_model(home: Path) -> Path:
    """~/models/Qwen2.5-0.5B: a tiny Qwen2 as a Hugging Face folder (config.json, random weights, GPT-2's tokenizer
    as tokenizer.json), standing in for the download the README names."""
    import transformers

    from geofed_hpc.data.tokenizer import load_tokenizer

    folder = home / "models" / "Qwen2.5-0.5B"
    shape = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    config = transformers.Qwen2Config(vocab_size=50257, max_position_embeddings=256, **shape)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    load_tokenizer("gpt2").save(folder, 256)
    return folder


def write_editor(where: Path) -> Path:
    """An $EDITOR that puts the local test cluster's values into the site file it is given."""
    local = yaml.safe_load((REPO / "conf" / "site" / "slurm_local.yaml").read_text())
    own = ("name", "num_sites", "first_shard", "shard_count", "embedded_ps", "token", "signal_delay", "max_requeues")
    values = {k: v for k, v in local.items() if k not in own} | {"num_sites": 1, "run_dir": "$HOME/scratch/runs"}
    editor = where / "editor"
    editor.write_text(
        f"#!{sys.executable}\nimport sys\nfrom pathlib import Path\nimport yaml\n"
        "path = Path(sys.argv[1])\nsite = yaml.safe_load(path.read_text())\n"
        f"site.update({values!r})\npath.write_text(yaml.safe_dump(site, sort_keys=False))\n"
    )
    editor.chmod(0o755)
    return editor


class Shell:
    """README lines run through bash on this machine, which stands in for every host the README names; what they
    start (`ps up` processes, Slurm jobs) is stopped by its id at `close`."""

    def __init__(self, root: Path, hosts: dict[str, str], subs: list[tuple[str, str]], slurm: str = "") -> None:
        self.machines = sorted(set(hosts.values()))
        self.homes = {m: root / m for m in self.machines}
        for home in self.homes.values():
            home.mkdir(parents=True)
        self.hosts, self.slurm = hosts, slurm
        self.ports = {m: free_pair() for m in self.machines}  # port + 1 stays free for a PS group's store
        self.metrics = {m: free_pair() for m in self.machines}
        self.subs = [
            (old, new.format(port=self.ports[self.machines[0]], metrics=self.metrics[self.machines[0]]))
            for old, new in subs
        ]
        self.vars: dict[str, str] = {}
        self.servers: list[tuple[subprocess.Popen[bytes], Path, str]] = []
        self.jobs: list[str] = []
        self.skipped: list[str] = []
        self.ran = 0
        self.editor = write_editor(root)

    def env(self, machine: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k == "SLURM_CONF" or not k.startswith(("SLURM_", "SUBMITIT_"))}
        env.pop("XDG_CONFIG_HOME", None)  # the user's site files in ~/.config/geofed-hpc, as the README says
        env.update(self.vars)
        env.update(
            HOME=str(self.homes[machine]),
            PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
            EDITOR=str(self.editor),
            WANDB_SILENT="true",
            HF_HUB_OFFLINE="1",
        )
        return env

    def expand(self, line: Line) -> str:
        text = line.text
        for old, new in [*line.subs, *self.subs]:
            text = text.replace(old, new)
        if text.startswith("ssh "):  # ssh HOST 'CMD': CMD in that machine's HOME
            _, host, command = text.split(" ", 2)
            home = self.homes[self.hosts[host]]
            text = f"cd {home} && HOME={home} bash -c {command}"
        if re.search(r"(^|&& )scp ", text):  # scp: a copy between this machine's HOMEs
            text = re.sub(r"(^|&& )scp ", r"\1cp ", text)
            for host, machine in self.hosts.items():
                text = re.sub(rf"(?<=\s){re.escape(host)}:(?!\d)", f"{self.homes[machine]}/", text)
        return text

    def do(self, line: Line) -> str:
        """Run `line` as its plan says; its output."""
        if line.how in (NOT_HERE, COVERED):
            return ""
        if line.how == SLURM and self.slurm:
            self.skipped.append(line.text)
            return ""
        text = self.expand(line)
        if line.how == PS_UP:
            self.start_ps(line, text)
            return ""
        self.wait_for_servers()
        assignment = re.fullmatch(r"([A-Z_]+)=\S.*", text)
        if assignment:  # a shell variable the next lines use: its value as bash makes it
            value = subprocess.run(
                ["bash", "-c", f'{text}\nprintf %s "${assignment[1]}"'],
                env=self.env(line.on),
                capture_output=True,
                text=True,
                check=True,
            )
            self.vars[assignment[1]] = value.stdout
            self.ran += 1
            return ""
        deadline = time.monotonic() + 60
        while True:
            result = subprocess.run(
                ["bash", "-c", text],
                cwd=self.homes[line.on],
                env=self.env(line.on),
                capture_output=True,
                text=True,
                timeout=300,
            )
            out = result.stdout + result.stderr
            if result.returncode == 0 and line.expect in out or not line.retry or time.monotonic() > deadline:
                break
            time.sleep(1)
        self.jobs += re.findall(r"^submitted \S+: job (\d+)", result.stdout, re.M)
        failed = f"{line.text}\n$ {text}\n{out}{self.server_logs()}"
        assert result.returncode == 0, f"README line failed (exit {result.returncode}): {failed}"
        assert line.expect in out, f"README line's output lacks {line.expect!r}: {failed}"
        self.ran += 1
        if "token issue" in text:
            self.subs.append(("site.token=TOKEN", f"site.token={result.stdout.split()[-1]}"))
        where = re.search(r"^run directory: (\S+)", result.stdout, re.M)
        if where and "runs/<federation>" not in dict(self.subs):
            self.subs.append(("runs/<federation>", where[1]))
        return out

    def start_ps(self, line: Line, text: str) -> None:
        port, metrics = self.ports[line.on], self.metrics[line.on]
        extra = f" ps.host=127.0.0.1 ps.port={port} ps.metrics_port={metrics} train.sync_interval=2s"
        log = self.homes[line.on] / f"ps-{len(self.servers)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["bash", "-c", f"exec {text}{extra}"],
                cwd=self.homes[line.on],
                env=self.env(line.on),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.servers.append((proc, log, line.text))
        self.ran += 1

    def server_logs(self) -> str:
        return "".join(f"\n--- {text}\n{log.read_text(errors='replace')[-3000:]}" for _, log, text in self.servers)

    def wait_for_servers(self) -> None:
        deadline = time.monotonic() + 120
        for proc, log, text in self.servers:
            while "parameter server on" not in log.read_text(errors="replace"):
                assert proc.poll() is None, f"README line exited ({proc.returncode}): {text}\n{log.read_text()}"
                assert time.monotonic() < deadline, f"README line did not serve in 120 s: {text}\n{log.read_text()}"
                time.sleep(0.2)

    def close(self) -> None:
        for job in self.jobs:
            subprocess.run(["scancel", job], capture_output=True, timeout=60)
        for proc, _, _ in self.servers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _, _ in self.servers:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)

    def done(self) -> None:
        """Skipped, naming them, when lines needing Slurm could not run."""
        if self.skipped:
            lines = "; ".join(self.skipped)
            pytest.skip(f"ran {self.ran} README lines; {len(self.skipped)} need Slurm ({self.slurm}): {lines}")


@pytest.fixture(scope="module")
def slurm_here() -> Iterator[str]:
    """Empty where a real Slurm answers (SLURM_CONF's, else slurm/start.sh's, started here as root and stopped
    afterwards, as tests/test_slurm.py does), else why there is none."""
    from tests.test_slurm import _ping

    if os.environ.get("SLURM_CONF") and _ping():
        yield ""
        return
    if os.geteuid() != 0:
        yield "needs a real Slurm: run as root (`make test` starts slurm/), or export SLURM_CONF of a running one"
        return
    slurm_dir = Path(os.environ.get("GEOFED_SLURM_DIR", REPO / ".slurm")).resolve()
    running = subprocess.run([REPO / "slurm" / "status.sh"], capture_output=True).returncode == 0
    if not running:
        subprocess.run([REPO / "slurm" / "start.sh"], check=True, timeout=600)
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(slurm_dir / "run" / "etc" / "slurm.conf")
    try:
        assert _ping(), "slurmctld does not answer"
        yield ""
    finally:
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
        if not running:
            subprocess.run([REPO / "slurm" / "stop.sh"], timeout=300)


@pytest.fixture
def cluster_shell(tmp_path: Path, slurm_here: str) -> Iterator[Shell]:
    """The VM and a cluster's login node (one HOME, with ~/corpus), the local test cluster behind it."""
    hosts = {"vm": "vm", "vm.example.org": "vm"}
    shell = Shell(tmp_path, hosts, SUBS_CLUSTER, slurm_here)
    write_corpus(shell.homes["vm"])
    try:
        yield shell
    finally:
        shell.close()


# ---------------------------------------------------------------- the tests
def test_every_readme_command_is_run_or_allow_listed() -> None:
    written = readme_commands()
    problems = [f"a ```bash block under '{h}' that PLANS does not know" for h in written if h not in PLANS]
    problems += [f"PLANS names a block the README no longer has: '{h}'" for h in PLANS if h not in written]
    for heading in set(written) & set(PLANS):
        planned = [line.text for line in PLANS[heading]]
        if written[heading] != planned:
            problems.append(_drift(heading, written[heading], planned))
    assert not problems, "\n".join(problems)
    for plan in PLANS.values():
        for line in plan:
            assert (line.how in (NOT_HERE, COVERED)) == bool(line.why), line


def test_lines_covered_elsewhere_name_what_runs_them() -> None:
    """`make demo` is the launch tests/test_local_federation.py runs; each benchmark line names a script and options
    that exist, and folders its results can be written to."""
    demo = re.search(r"^demo:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.M)
    assert demo and "geofed-hpc launch site=local model=tiny run_dir=" in demo[1], demo
    for line in [line for plan in PLANS.values() for line in plan if line.how == COVERED]:
        test = re.search(r"(tests/\w+\.py)::(\w+)", line.why)
        assert test, line
        source = (REPO / test[1]).read_text()
        assert f"def {test[2]}(" in source and all(f'"{w}"' in source for w in ("launch", "site=local", "model=tiny"))
    benchmarks = "Benchmarks (scripts, not tests; each writes JSON and prints a table against a same-run baseline)"
    for line in PLANS[benchmarks]:
        words = shlex.split(line.text)
        script = REPO / next(w for w in words if w.startswith("bench/"))
        source = script.read_text()
        for i, word in enumerate(words):
            if word.startswith("--"):
                assert f'"{word}"' in source, (line.text, word)
                if word in ("--json", "--png"):  # its folder is in the checkout, or the script makes it
                    assert (REPO / words[i + 1]).parent.is_dir() or ".parent.mkdir(" in source, line.text


@pytest.mark.slurm
@pytest.mark.slow
def test_on_real_clusters(cluster_shell: Shell) -> None:
    """The VM's lines, then a login node's (its site file made as "On a cluster" below makes it), against the local
    test cluster; the token is revoked last."""
    login = {line.text: line for line in PLANS["On a cluster: from `git clone` to the first `launch`"]}
    for line in plan_of("On real clusters"):
        if line.text == RUN_LLAMA:  # "see On a cluster below": the CA copied from the VM, the user's site file
            for step in ("mkdir -p ~/geofed", "geofed-hpc site new osc", "$EDITOR"):
                cluster_shell.do(next(v for k, v in login.items() if k.startswith(step)))
        cluster_shell.do(line)
    cluster_shell.done()


@pytest.mark.slurm
@pytest.mark.slow
def test_on_a_cluster_from_git_clone_to_the_first_launch(cluster_shell: Shell) -> None:
    """What the VM did first ("On the PS's VM, once: `ps init`, `ps up`, `token issue`"), then the login node's
    steps in order."""
    for line in plan_of("On real clusters")[:3]:
        cluster_shell.do(line)
    for line in plan_of("On a cluster: from `git clone` to the first `launch`"):
        cluster_shell.do(line)
    assert (cluster_shell.homes["vm"] / "venvs" / "geofed" / "bin" / "activate").is_file()
    cluster_shell.done()


@pytest.mark.slow
def test_several_parameter_servers(tmp_path: Path) -> None:
    """Two `ps up` peers, each on its own HOME (a VM of its own), meet with the secret the block makes and copies."""
    hosts = {"ps-east.example.org": "east", "ps-eu.example.org": "eu"}
    shell = Shell(tmp_path, hosts, [])
    east, eu = shell.ports["east"], shell.ports["eu"]
    shell.subs = [
        ("ps-east.example.org:50051", f"127.0.0.1:{east}"),
        ("ps-eu.example.org:50051", f"127.0.0.1:{eu}"),
        ("127.0.0.1:50051", f"127.0.0.1:{east}"),
    ]
    try:
        for line in plan_of("Several parameter servers (a PS group, one per region)"):
            out = shell.do(line)
            if line.subs:  # the composed config carries the address list as written
                first, second = (east, eu) if "site=osc" in line.text else (eu, east)
                assert f"  address:\n  - 127.0.0.1:{first}\n  - 127.0.0.1:{second}\n" in out, out
        secret = shell.homes["eu"] / ".geofed" / "peer.secret"
        assert secret.read_text() == (shell.homes["east"] / ".geofed" / "peer.secret").read_text()
        assert secret.stat().st_mode & 0o077 == 0 and len(secret.read_text().strip()) == 64
    finally:
        shell.close()


@pytest.mark.slow
def test_from_a_corpus_to_a_hugging_face_model(tmp_path: Path) -> None:
    shell = Shell(tmp_path, {"vm": "vm"}, [])
    write_corpus(shell.homes["vm"])
    try:
        for line in plan_of("From a corpus to a Hugging Face model"):
            shell.do(line)
    finally:
        shell.close()
    assert (shell.homes["vm"] / "out" / "fed-model" / "model.safetensors").is_file()


@pytest.mark.slow
def test_your_own_training_loop(tmp_path: Path) -> None:
    """A `ps up`, then two sites running examples/torch_loop.py (the plain loop federated by `geofed_hpc.Site`); then
    `launch script=` running it as two local site jobs."""
    shell = Shell(tmp_path, {"vm": "vm"}, SUBS_CLUSTER)
    try:
        for line in plan_of("Your own training loop"):
            shell.do(line)
    finally:
        shell.close()
    for index in (0, 1):
        ckpt = tmp_path / "vm" / "runs" / "geofed" / "sites" / f"local-{index}" / "ckpt"
        assert (ckpt / "loop-000000060.gft").is_file(), sorted(ckpt.iterdir())
        launched = tmp_path / "vm" / "runs" / "mine" / "sites" / f"local-{index}" / "ckpt"  # `launch script=`'s jobs
        assert (launched / "loop-000000060.gft").is_file(), sorted(launched.iterdir())


@pytest.mark.slow
def test_your_own_model(tmp_path: Path) -> None:
    """model=hf from a Hugging Face folder: two local sites train it, `export hf` writes it, transformers loads it."""
    shell = Shell(tmp_path, {"vm": "vm"}, [])
    folder = write_own_model(shell.homes["vm"])
    try:
        for line in plan_of("Your own model"):
            shell.do(line)
    finally:
        shell.close()
    out = shell.homes["vm"] / "out" / "own-model"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()  # the folder's
