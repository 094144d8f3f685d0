"""RL post-training settings: ``program: grpo`` or ``ppo`` and the ``rl`` section.

``program``: ``pretrain`` (the default: next-token training on ``data``), ``sft`` (chat data:
core.config.sft), ``grpo`` or ``ppo``.
``task: counting`` asks counts to continue (``5 6 7 8`` → ``9 10 ..``, every response
``max_response_length`` long); ``task: count_to`` asks a count up to a target given first
(``12 7 8 9`` → ``10 11 12 <eot>``): answers of different lengths that end at the
end-of-text token, the vocabulary's last id (``reward: count_to``; core.rl.tasks).
``task: file`` asks the prompts of the ``prompts`` file (JSONL or Parquet; in ``prompt_key``
text, or chat messages rendered with the tokenizer's chat template and its generation
prompt), tokenized with ``tokenizer`` and left-padded to ``prompt_length``. ``tokenizer``:
``byte``, ``qwen3``, ``hf`` (the ``init_from: hf:PATH`` folder's tokenizer and chat template;
the default when ``init_from`` is ``hf:``, else ``byte``) or a local Hugging Face folder
(core.config.tokvocab). A response ends at its first ``stop`` token (token strings or ids;
default: the tokenizer's stop tokens, generation_config.json's ``eos_token_id`` for a
Hugging Face folder, else its end of text); the reward's ``response_text`` ends before it.
``chat_template_kwargs`` (a mapping of simple values) are extra variables of every chat
template render, as ``apply_chat_template(..., **kwargs)`` passes them (Qwen3 switches
thinking off with ``enable_thinking: false``); the names apply_chat_template sets itself are refused.
Under ``grpo`` the first ``rl.warmup_steps`` steps are supervised steps on ``data`` (a warm
start: a policy that never succeeds gets no signal), then every step is one GRPO iteration:
``prompts_per_step`` prompts of ``prompt_length`` tokens from ``rl.task``, each answered
``n`` times (the group, verl's ``rollout.n``) by the generator group with ``temperature`` /
``top_k`` / ``top_p`` and ``max_response_length`` new tokens; ``reward`` scores every
response (a built-in name: ``counting``, ``exact_match``, ``math``; or the user's
``module:function``, see core.rl.rewards) in ``reward_workers`` processes of the controller
(default 1: a process of its own, so that a reward can be bounded and killed, on the one CPU a
Slurm task gets unless ``slurm`` gives the controller more; raise it with the controller's
CPUs when rewards are slow, math-verify's take milliseconds each), each call bounded by
``reward_timeout_s`` (default 60): a reward that raises, returns no finite number, crashes its
process or outlives its bound fails the step as a user error naming the reward and the
prompt (exit 2, not retried; core.rl.reward_pool), and the same rewards come out whatever the
pool's size (``exact_match`` and ``math`` read a file task's text and answers: ``task: file``;
submit imports a ``module:function`` from PYTHONPATH in a subprocess and refuses one that cannot
be loaded, naming why); ``n`` is at least 2 under ``grpo`` (a group of one has no baseline);
advantages are group-normalised (``norm_adv_by_std``: divide by the
group's std, else only subtract its mean); the actor takes ``ppo_epochs`` epochs over the
step's responses on the clipped objective (``clip_low``, ``clip_high``, dual clip ``clip_c``;
the log-ratio clamped to ±20 before exp) with the actor's own log-probs before the update
as the old policy's; then the generator is synced.
An epoch is one optimizer step per
``mini_batch_size`` responses (verl's ``ppo_mini_batch_size``, global over the data-parallel
replicas; it divides prompts_per_step × n and splits evenly over dp), in order; None: one
step on all of them. ``loss_agg_mode`` (verl's names and meanings) aggregates every loss
term (policy, KL, entropy, the critic's value loss) over the whole mini-batch, every
micro-batch and replica together: ``token-mean`` (every response token weighs the same),
``seq-mean-token-mean`` (every response the same: the mean over responses of each one's
token mean), ``seq-mean-token-sum-norm`` (Dr. GRPO: the token sums over responses ×
``max_response_length``); the gradient does not depend on ``training.micro_batch_size``, dp
or the order of the rows. ``entropy_coef``: an entropy bonus, the loss less coef × the
aggregated entropy of the actor's distribution (0: not computed in the update). The
updates run with dropout off, and the old log-probs are scored in the update's micro-batches
(the first epoch's ratio is exactly 1). A micro-batch is ``training.micro_batch_size`` rows
in order, or with ``max_tokens_per_micro_batch`` (verl's dynamic batch size) rows grouped by
length, longest first, as many as keep rows × the longest within that many tokens (a row
longer than it alone); either way each micro-batch is padded to its own longest row, not to
``model.seq_length``, and the log-probs and entropy take ``LOGIT_CHUNK_TOKENS`` positions
at a time (core.model.gpt.logprobs).
``max_staleness`` (split placement only): the rollouts run up to that many policy versions
ahead of the trainer on a fixed schedule (core.controller.rollouts): with 1, step t + 1's
rollout is generated from policy t while policy t is updated; 0 (the default) is synchronous.
Every log-prob (the rollout's, the old policy's, the reference's, the update's) and the
entropy are of the distribution sampled from at ``temperature``: log-softmax of logits /
``temperature``, before top-k / top-p truncation (as verl computes them).

``val_every``: every that many RL steps (0 or None: never), and after the last step, the
policy answers held-out prompts greedily and sampled (``temperature`` / ``top_k`` /
``top_p``), scored by ``reward``: ``val_reward_mean`` and ``val_reward_mean_sampled`` in the
step's record, the responses in samples.jsonl (core.controller.validation). The prompts:
``val_prompts`` (a file task: the same format, tokenizer and checks as ``prompts``; required
with ``val_every``, refused without it), else the built-in task's held-out set (``prompts_per_step`` prompts from
a seed of their own, not guaranteed disjoint from training's). ``prompt_length + max_response_length`` is at most the
model's ``seq_length`` (the generator holds the prompt and every new token).

``program: ppo`` is the same iteration with a critic instead of group baselines: a value
model (the actor's transformer with a one-output value head, not split over tensor
parallelism; its own optimizer; copied from the actor when the RL phase begins) scores
every response token, the reward (the response's score on its last token) and the values
give GAE advantages (``gamma``, ``lam``; whitened over the step's response tokens) and
returns, and the critic takes ``ppo_epochs`` epochs of mini-batch steps on the clipped
value loss (``critic.value_clip``) at ``critic.lr`` before the actor's update.

``kl``: a KL penalty to the reference policy (the actor when RL began: the end of the warm
start, or ``init_from``) in the actor's loss, ``coef`` × the ``estimator`` (k1, abs, mse,
k3 ``low_var_kl``) aggregated by ``loss_agg_mode``; the step's recorded ``kl``, which the
adaptive controller follows, is its token mean whatever the mode. ``coef: auto`` is a heuristic, not a law:
max(1e-3, 0.02 ln(parameters in billions)). With ``target`` the coefficient adapts each
step towards that KL over ``horizon`` responses (the adaptive controller). ``coef: 0`` and
no target: no reference model at all.

``init_from: RUN_DIR[:STEP]`` (any program): the run starts from the model weights of a
committed checkpoint of another run (its newest without STEP; any layout), with a fresh
optimizer; under ``grpo`` with no warm start, its weights are the reference policy. ``baton submit``
checks it and stores it resolved (absolute, with its step), so every allocation of the run
starts from, and compares against, the same weights. ``init_from: hf:PATH`` starts from a
Hugging Face checkpoint folder instead (Llama 3.x, Qwen2/2.5, Qwen3 dense: core.config.hfinit
fills the model section from its config.json; submit checks its files and pins PATH absolute).

What these settings need from the rest of the config (a GPT, a generator, lengths within
the model's) is checked by ``core.config.run`` against the whole config.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from core.config import tokvocab
from core.config.inputs import check_file
from core.config.schema import bounded, check_bounds
from core.errors import ConfigError

PROGRAMS = ("pretrain", "sft", "grpo", "ppo")  # sft: core.config.sft
RL_PROGRAMS = ("grpo", "ppo")
BUILTIN_REWARDS = ("counting", "count_to", "exact_match", "math")  # core.rl.rewards.BUILTIN
PLAIN_REWARDS = ("counting", "count_to", "exact_match")  # built-ins of the standard library alone: nothing to check at submit
TEXT_REWARDS = ("exact_match", "math")  # read the response's text and the record's answer: rl.task: file
# apply_chat_template's own parameters: never template variables (core.data.hf_tokenizer.RESERVED_VARIABLES)
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message")
# Positions (a micro-batch's rows × width) whose fp32 logits the log-prob and entropy take at a
# time (core.model.gpt.logprobs); the plan sizes that pass's temporaries with it.
LOGIT_CHUNK_TOKENS = 1024


@dataclass(frozen=True, kw_only=True)
class KLConfig:
    coef: float | Literal["auto"] = bounded(0.001, ge=0, le=1e3)
    estimator: Literal["k1", "abs", "mse", "low_var_kl"] = "low_var_kl"  # core.model.gpt.rl_loss.KL_ESTIMATORS
    target: float | None = bounded(None, gt=0, le=1e3)  # adaptive: the KL the coefficient steers towards
    horizon: int = bounded(10000, gt=0, le=2**40)  # responses over which the adaptive coefficient moves

    def __post_init__(self) -> None:
        check_bounds(self, "rl.kl")

    @property
    def enabled(self) -> bool:
        """Whether the run needs a reference model."""
        return self.coef == "auto" or self.coef > 0 or self.target is not None


@dataclass(frozen=True, kw_only=True)
class CriticConfig:
    """``program: ppo``'s value model."""

    lr: float | None = bounded(None, gt=0, le=1e3)  # None: the actor's (rl.lr, else the optimizer's schedule)
    value_clip: float = bounded(0.5, gt=0, le=1e6)  # new values stay within this of the old in the loss

    def __post_init__(self) -> None:
        check_bounds(self, "rl.critic")


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    warmup_steps: int = bounded(0, ge=0, le=10**12)
    task: Literal["counting", "count_to", "file"] = "counting"
    prompts: str | None = None  # task file: a .jsonl or .parquet of prompts (core.data.prompts)
    val_prompts: str | None = None  # task file: held-out prompts for validation, as ``prompts``
    val_every: int | None = bounded(None, ge=0, le=2**40)  # RL steps between validations; 0/None: none
    prompt_key: str = "prompt"
    tokenizer: str | None = None  # task file: byte, qwen3, hf or a local folder; None: hf with init_from hf:, else byte
    stop: tuple[int | str, ...] | None = None  # task file: stop tokens (strings or ids); None: the tokenizer's
    # task file: extra chat template variables for every render (Qwen3: {enable_thinking: false})
    chat_template_kwargs: dict[str, bool | int | str | float | None] = field(default_factory=dict)
    reward: str = "counting"
    reward_workers: int = bounded(1, gt=0, le=1024)  # reward processes on the controller's node
    reward_timeout_s: float = bounded(60.0, gt=0, le=86400)  # one reward call's bound
    prompts_per_step: int = bounded(4, gt=0, le=2**20)
    n: int = bounded(8, gt=0, le=2**16)
    prompt_length: int = bounded(4, gt=0, le=2**20)
    max_response_length: int = bounded(8, gt=0, le=2**20)
    temperature: float = bounded(1.0, gt=0, le=1e3)
    top_k: int = bounded(0, ge=0, le=2**26)
    top_p: float = bounded(1.0, gt=0, le=1)
    ppo_epochs: int = bounded(1, gt=0, le=2**10)
    mini_batch_size: int | None = bounded(None, gt=0, le=2**30)  # rows per optimizer step; None: the step's all
    # padded tokens (rows × longest row) per micro-batch of the updates and scoring; 0: training.micro_batch_size rows
    max_tokens_per_micro_batch: int = bounded(0, ge=0, le=2**40)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    entropy_coef: float = bounded(0.0, ge=0, le=1e3)  # the loss less coef × the entropy; 0: none computed
    clip_low: float = bounded(0.2, ge=0, le=1)
    clip_high: float = bounded(0.28, ge=0, le=1e3)
    clip_c: float = bounded(3.0, gt=1, le=1e3)
    norm_adv_by_std: bool = True
    lr: float | None = bounded(None, gt=0, le=1e3)  # the actor's in RL steps; None: the optimizer's schedule
    kl: KLConfig = field(default_factory=KLConfig)
    gamma: float = bounded(1.0, ge=0, le=1)  # ppo: GAE's discount
    lam: float = bounded(1.0, ge=0, le=1)  # ppo: GAE's lambda
    critic: CriticConfig = field(default_factory=CriticConfig)
    # split placement: the rollout of step t + 1 overlaps step t's update; no rollout comes from a
    # policy more than max_staleness versions older than the one it updates (0: synchronous)
    max_staleness: int = bounded(0, ge=0, le=2**10)

    def __post_init__(self) -> None:
        check_bounds(self, "rl")

    def validates(self, done: int, steps: int) -> bool:
        """Whether the policy after ``done`` steps (of ``steps``) is validated: every
        ``val_every`` RL steps, and after the last step once the RL phase has begun."""
        rl_done = done - self.warmup_steps
        if not self.val_every or rl_done <= 0:
            return False
        return rl_done % self.val_every == 0 or done == steps


def init_from(value: str) -> tuple[str, int | None]:
    """``init_from: RUN_DIR[:STEP]``: (RUN_DIR, STEP or None: its newest checkpoint)."""
    head, sep, tail = value.rpartition(":")
    if sep and tail.isdigit():
        return head, int(tail)
    return value, None


TOKENIZER_VOCAB = tokvocab.BUILTIN_VOCAB  # core.data.tokenizer's built-ins


def check_task(rl: RLConfig, *, vocab_size: int, init_from: str | None = None) -> None:
    """``rl.task`` and what it reads: the prompts file, a tokenizer the model's vocabulary
    holds, stop tokens of that tokenizer."""
    if rl.task != "file":
        for key, value in (("rl.prompts", rl.prompts), ("rl.val_prompts", rl.val_prompts), ("rl.stop", rl.stop),
                           ("rl.chat_template_kwargs", rl.chat_template_kwargs or None)):
            if value is not None:
                extra = " (count_to's end of text is model.vocab_size - 1)" if key == "rl.stop" else ""
                raise ConfigError(f"{key}: {value!r} is read only with rl.task: file (now {rl.task!r}){extra}; "
                                  f"set rl.task=file or drop {key}")
        if rl.reward == "count_to" and rl.task != "count_to":
            raise ConfigError(f"rl.reward: count_to scores rl.task: count_to's prompts (now {rl.task!r}); "
                              "set rl.task=count_to or another reward")
        if rl.task == "count_to":
            check_count_to(rl, vocab_size=vocab_size)
        return
    if rl.prompts is None:
        raise ConfigError("rl.task: 'file' needs rl.prompts: a .jsonl or .parquet file of prompts")
    check_file("rl.prompts", rl.prompts, "give a .jsonl or .parquet file of prompts")
    if rl.val_every and rl.val_prompts is None:
        raise ConfigError(f"rl.val_every: {rl.val_every} with rl.task: file needs rl.val_prompts: a .jsonl or "
                          ".parquet file of held-out prompts (never the training prompts); give one or drop "
                          "rl.val_every")
    if rl.val_prompts is not None and not rl.val_every:
        raise ConfigError(f"rl.val_prompts: {rl.val_prompts!r} has no effect without rl.val_every; set "
                          "rl.val_every=K (validate every K RL steps) or drop rl.val_prompts")
    if rl.val_prompts is not None:
        check_file("rl.val_prompts", rl.val_prompts, "give a .jsonl or .parquet file of held-out prompts")
    check_template_variables("rl.chat_template_kwargs", rl.chat_template_kwargs)
    tokvocab.check(rl.tokenizer, init_from, rl.stop, vocab_size=vocab_size)


def check_count_to(rl: RLConfig, *, vocab_size: int) -> None:
    """``rl.task: count_to`` (core.rl.tasks.count_to): a prompt holds the target and at least one
    number, an answer at least one number and its end-of-text token, and the vocabulary holds
    the prompt's numbers, one more and the end-of-text id."""
    for key, value, least in (("rl.prompt_length", rl.prompt_length, 2),
                              ("rl.max_response_length", rl.max_response_length, 2),
                              ("model.vocab_size", vocab_size, rl.prompt_length + 1)):
        if value < least:
            raise ConfigError(f"{key}: {value} < {least}: rl.task: count_to asks a target and the start of a count "
                              "(prompt_length ≥ 2) for at least one more number and the end-of-text token "
                              "(max_response_length ≥ 2) below model.vocab_size; raise it")


def check_template_variables(key: str, variables: dict[str, object]) -> None:
    """Extra chat template variables: none of the names apply_chat_template sets itself."""
    if clash := [name for name in variables if name in RESERVED_TEMPLATE_VARIABLES]:
        raise ConfigError(f"{key}: {', '.join(clash)} is set by the chat template call itself, not a template "
                          f"variable; drop it from {key}")
