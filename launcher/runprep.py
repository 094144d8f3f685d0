"""Prepare a run folder on the login node: resolved config, plan, keys, initial state.

Pure preparation, no submission: both backends call ``prepare_run`` (new run) or
``prepare_resume`` (an existing folder, next epoch) and then start processes their way.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from core.checkpoint import manifest
from core.config import rl as rl_spec
from core.config import run as config_mod
from core.config import sft as sft_spec
from core.config import tokvocab
from core.config.run import RunConfig
from core.config.runplan import plan_run
from core.errors import ConfigError, UserError
from core.hf import families as hf_families
from core.hf import files as hf_files
from core.hf import layout as hf_layout
from core.record import discovery
from core.record import events as ev
from core.record.lock import controller_alive, cross_node_notice
from core.record.runfolder import RunFolder, write_atomic
from core.record.state import RunRecord, RunState


def generate_keys(keys_dir: Path) -> None:
    """CURVE keys via a subprocess: the login-node CLI never imports zmq itself."""
    proc = subprocess.run(
        [sys.executable, "-m", "core.wire.transport", "keygen", str(keys_dir)],
        capture_output=True, text=True, timeout=60,
    )
    if proc.returncode != 0:
        raise UserError(f"{keys_dir}: key generation failed: {proc.stderr.strip().splitlines()[-1:]}")


_SAID: set[Path] = set()


def say_lock(folder: Path) -> None:
    """One line on stderr, once per folder, when its filesystem gives no cross-node lock (Baton
    uses a lease file there); a UserError when no lock can work (core.record.lock)."""
    notice = cross_node_notice(folder)
    if notice is not None and folder not in _SAID:
        _SAID.add(folder)
        print(f"baton: warning: {notice}", file=sys.stderr)


def checked(cfg: RunConfig) -> tuple[RunConfig, tuple[str, bytes] | None]:
    """Every input of a new run checked on the login node, nothing written: ``init_from``
    (pinned: ``resolve_init``), the files a relative path names stored resolved (a later
    resume from another folder reads the same ones), an SFT run's conversations and an RL
    file task's prompts read through their tokenizer. The config to store, and an SFT run's
    tokenized conversations (``check_sft``)."""
    say_lock(Path(cfg.runs_root).expanduser().resolve())
    cfg = resolve_init(cfg)
    if cfg.rl.prompts and not Path(cfg.rl.prompts).is_absolute():
        cfg = replace(cfg, rl=replace(cfg.rl, prompts=str(Path(cfg.rl.prompts).resolve())))
    if cfg.rl.val_prompts and not Path(cfg.rl.val_prompts).is_absolute():
        cfg = replace(cfg, rl=replace(cfg.rl, val_prompts=str(Path(cfg.rl.val_prompts).resolve())))
    tok = cfg.rl.tokenizer
    if tok is not None and tok not in rl_spec.TOKENIZER_VOCAB and tok != "hf":
        folder = tok.removeprefix("hf:")
        if not Path(folder).is_absolute():
            cfg = replace(cfg, rl=replace(cfg.rl, tokenizer=str(Path(folder).resolve())))
    if cfg.data.path and not Path(cfg.data.path).is_absolute():
        cfg = replace(cfg, data=replace(cfg.data, path=str(Path(cfg.data.path).resolve())))
    cfg = resolve_sft(cfg)
    check_prompts(cfg)
    check_reward(cfg)
    return pin_sd_dir(cfg), check_sft(cfg)


def pin_sd_dir(cfg: RunConfig) -> RunConfig:
    """``metrics.sd_dir`` checked here (a folder, or one to create, writable) and stored absolute."""
    m = cfg.metrics
    if not m.enabled or m.sd_dir is None:
        return cfg
    return replace(cfg, metrics=replace(m, sd_dir=discovery.check_sd_dir(m.sd_dir)))


def prepare_run(cfg: RunConfig, *, backend: str, run_id: str | None = None) -> RunFolder:
    """Create the run folder of a validated config (``checked`` first): config, plan, keys,
    the first state."""
    cfg, conversations = checked(cfg)
    run = RunFolder.create(Path(cfg.runs_root).expanduser().resolve(), cfg.name, run_id)
    if conversations is not None:  # every allocation trains on what was checked here
        write_atomic(run.path / conversations[0], conversations[1])
    write_atomic(run.config, config_mod.dump(cfg))
    write_atomic(run.plan, plan_run(cfg).to_json())
    generate_keys(run.keys)
    now = time.time()
    RunRecord(run).create(RunState(total_steps=cfg.trainer.steps, created=now, updated=now), ev.Created(backend=backend))
    return run


def check_prompts(cfg: RunConfig) -> None:
    """An RL file task: every prompt of ``rl.prompts`` (and ``rl.val_prompts``) read, rendered
    and tokenized as the controller will, so a bad record or a prompt longer than
    ``rl.prompt_length`` is refused here, naming it (core.data.prompts), not when the job starts."""
    if cfg.program not in rl_spec.RL_PROGRAMS or cfg.rl.task != "file":
        return
    from core.data import prompts, tokenizer  # the tokenizer's libraries: only a file task's submit reads prompts

    try:
        tok = tokenizer.load_tokenizer(tokvocab.source(cfg.rl.tokenizer, cfg.init_from))
    except UserError as exc:  # the tokenizer library's words: the key that named the files first
        raise ConfigError(str(exc) if str(exc).startswith("rl.") else f"rl.tokenizer: {exc}") from None
    for what, path in (("rl.prompts", cfg.rl.prompts), ("rl.val_prompts", cfg.rl.val_prompts)):
        if path is not None or what == "rl.prompts":
            prompts.read_prompts(path or "", key=cfg.rl.prompt_key, tokenizer=tok, length=cfg.rl.prompt_length,
                                 template_variables=cfg.rl.chat_template_kwargs, what=what)


REPO_ROOT = Path(__file__).resolve().parents[1]  # what the controller's PYTHONPATH starts with (launcher.local)
REWARD_CHECK_S = 120.0  # importing a reward module on the login node takes at most this


def check_reward(cfg: RunConfig) -> None:
    """An RL run's ``rl.reward`` loaded as the controller's reward processes will load it (its
    module found on PYTHONPATH, compiled and imported, its function there), in a subprocess: the
    CLI never imports the user's module (nor torch, which it may import). A failure is a
    one-line ConfigError naming ``rl.reward`` and the cause (core.rl.reward_check)."""
    spec = cfg.rl.reward
    if cfg.program not in rl_spec.RL_PROGRAMS or spec in rl_spec.PLAIN_REWARDS:
        return
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    try:  # from an empty folder: on Slurm the controller runs in the run folder, so only PYTHONPATH finds it
        with tempfile.TemporaryDirectory(prefix="baton-reward-check-") as nowhere:
            proc = subprocess.run([sys.executable, "-m", "core.rl.reward_check", spec], capture_output=True,
                                  text=True, env=env, cwd=nowhere, timeout=REWARD_CHECK_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"rl.reward: importing {spec.partition(':')[0]!r} took more than {REWARD_CHECK_S:.0f} s "
                          "on the login node; make the module's import quick (no work at import time)") from None
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit code {proc.returncode}"
        raise ConfigError(last if last.startswith("rl.reward: ") else
                          f"rl.reward: loading {spec!r} ended the check with exit code {proc.returncode} ({last}); "
                          "fix the module")


def resolve_sft(cfg: RunConfig) -> RunConfig:
    """``program: sft``'s data file and tokenizer folder stored absolute, as data.path is."""
    s = cfg.sft
    if cfg.program != "sft" or s.data is None:
        return cfg
    tokenizer = s.tokenizer if s.tokenizer in (sft_spec.BYTE, sft_spec.FROM_INIT) else str(Path(s.tokenizer).resolve())
    return replace(cfg, sft=replace(s, data=str(Path(s.data).resolve()), tokenizer=tokenizer))


def check_sft(cfg: RunConfig) -> tuple[str, bytes] | None:
    """``program: sft``: every record of the data file is a conversation that fits the model (a
    one-line UserError naming the record otherwise); the run folder's file name and bytes of
    the conversations, tokenized, for the workers (core.data.sft.FROZEN). None for other programs."""
    if cfg.program != "sft":
        return None
    from core.data import sft as chat  # numpy and the tokenizer's libraries: only an SFT submit reads conversations

    s = cfg.sft
    assert s.data is not None  # core.config.sft.check
    conversations = chat.check(s.data, key=s.messages_key, tokenizer=sft_spec.tokenizer_path(s, cfg.init_from),
                               seq_length=cfg.model.seq_length, vocab_size=cfg.model.vocab_size, too_long=s.too_long,
                               variables=s.chat_template_kwargs)
    return chat.FROZEN, chat.to_bytes(conversations)


def resolve_init(cfg: RunConfig) -> RunConfig:
    """``init_from`` checked (a committed checkpoint of the same model) and pinned: absolute,
    with its step, so a later allocation never starts from a newer checkpoint of that run."""
    if cfg.init_from is None:
        return cfg
    folder = hf_families.split_source(cfg.init_from)
    if folder is not None:
        return resolve_hf(cfg, folder)
    run_dir, step = rl_spec.init_from(cfg.init_from)
    step_dir = manifest.init_checkpoint(run_dir, step)
    saved = manifest.read_manifest(step_dir)
    if saved.config_hash not in (None, config_mod.model_hash(cfg)):
        raise UserError(f"init_from: {step_dir} was saved with another model (config hash {saved.config_hash}, this "
                        f"config {config_mod.model_hash(cfg)}); give the model section that run had")
    return replace(cfg, init_from=f"{step_dir.parent.parent.resolve()}:{saved.step}")


def resolve_hf(cfg: RunConfig, source: str) -> RunConfig:
    """``init_from: hf:PATH`` (``source``: PATH) checked (every tensor the model needs, of
    config.json's shape, in readable safetensors files) and pinned absolute."""
    folder = Path(source).expanduser().resolve()
    hf_files.check_folder(folder, hf_layout.dims_of(cfg.model))
    return replace(cfg, init_from=f"hf:{folder}")


@dataclass(frozen=True)
class Resume:
    """A checked resume of a run folder: nothing written yet (``begin_resume`` writes)."""

    run: RunFolder
    cfg: RunConfig
    epoch: int
    overrides: tuple[str, ...]
    from_scratch: bool
    notes: tuple[str, ...]  # what the user must hear about the run's checkpoints


def check_resume(run_dir: Path, overrides: list[str], *, from_scratch: bool = False) -> Resume:
    """Everything a resume needs, checked on the login node before anything is written: the run
    folder and its record, no live controller, the config with its overrides, the checkpoints
    the record says were committed (the newest gone: refused unless ``from_scratch``), a
    checkpoint to resume from that fits the (possibly changed) model. A refusal is a one-line
    UserError; a storage error reading a checkpoint a one-line TransientIOError (the CLI: exit 1)."""
    run = RunFolder.open(run_dir.expanduser().resolve())
    state = RunRecord(run).read()
    say_lock(run.path)
    live = controller_alive(run)
    if live is not None:
        raise UserError(f"{run.path}: its controller still runs ({live}); wait for it, or end it first "
                        "(`baton cancel`), then resume")
    cfg = pin_sd_dir(config_mod.load(run.config, overrides))
    refusal, gone = manifest.vanished(run.checkpoints, state.checkpoints)
    if refusal is not None and not from_scratch:
        raise UserError(refusal)
    intact, problems = manifest.newest_intact(run.checkpoints)
    if refusal is not None:  # --from-scratch: the user gives the missing ones up
        gone = [refusal.split("; restore", 1)[0] + "; --from-scratch: going on without them", *gone]
    notes = gone + [f"checkpoint {p} (skipped)" for p in problems] + manifest.findings(run.checkpoints)
    if intact is None and (problems or manifest.damaged(run.checkpoints)) and not from_scratch:
        raise UserError(f"{run.checkpoints}: no checkpoint to resume from ({'; '.join(problems) or 'all damaged'}); "
                        "the run does not start over by itself: add --from-scratch to start again from step 0")
    if intact is not None:
        saved = manifest.read_manifest(intact).config_hash
        if saved not in (None, config_mod.model_hash(cfg)):
            changed = [o for o in overrides if o.split("=", 1)[0].startswith("model.")]
            raise UserError(f"{intact}: saved with another model than {', '.join(changed) or 'config.yaml'} gives "
                            "(the model section must stay as the checkpoint has it); resume without changing model.*")
    return Resume(run=run, cfg=cfg, epoch=state.restarts + 1, overrides=tuple(overrides), from_scratch=from_scratch,
                  notes=tuple(notes))


def begin_resume(resume: Resume) -> None:
    """Write what a checked resume changes: config (overrides), plan, the next epoch in the record."""
    run = resume.run
    if resume.overrides:
        write_atomic(run.config, config_mod.dump(resume.cfg))
    write_atomic(run.plan, plan_run(resume.cfg).to_json())  # planned again: a plan of an older Baton is replaced
    RunRecord(run).append(ev.ResumeRequested(epoch=resume.epoch, overrides=resume.overrides,
                                             from_scratch=resume.from_scratch))


def prepare_resume(run_dir: Path, overrides: list[str], *, from_scratch: bool = False
                   ) -> tuple[RunFolder, RunConfig, int]:
    """``check_resume`` then ``begin_resume``: re-open a run folder for its next epoch."""
    resume = check_resume(run_dir, overrides, from_scratch=from_scratch)
    begin_resume(resume)
    return resume.run, resume.cfg, resume.epoch
