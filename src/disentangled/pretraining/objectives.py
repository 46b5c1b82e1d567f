"""Pretraining objectives: replaced-token detection with embedding sharing (DeBERTa-v3), and masked LM.

The heads (`DisentangledForMaskedLM` with the Enhanced Mask Decoder, `DisentangledForReplacedTokenDetection`) are
ordinary models; this module holds what pretraining adds around them, and hands `Trainer` one module whose forward
returns the loss:

- `MaskingCollator`: picks 15% of the tokens (or of the words, `whole_word_mask`) and corrupts them: for MLM 80% [MASK]
  / 10% a random token / 10% unchanged; for RTD every picked token becomes [MASK] (the generator's input).
- `ReplacedTokenDetectionPretraining`: the generator predicts the masked tokens; a sample of its prediction
  (temperature 1, no gradient) replaces each of them; the discriminator labels every token replaced (1) or original
  (0), a sample equal to the original counting as original.

      loss = L_MLM(generator) + rtd_weight * L_RTD(discriminator)          (one optimizer over both)

- Embedding sharing between generator and discriminator (word table, and the absolute position table where both have
  one), built by construction in the discriminator's forward:

      gdes: E_D = sg(E_G) + E_delta     E_delta zero-initialised; L_RTD reaches E_delta only, L_MLM never reaches it
      es:   E_D = E_G                   one table, both losses update it
      none: E_D, E_G separate tables

- `MaskedLMPretraining`: the MLM objective alone (v1/v2-style models, and the baseline).
- `PretrainingTrainer`: `Trainer` that adds the objective's running metrics (generator and discriminator losses, the
  discriminator's ROC-AUC, precision and recall on replaced tokens, generator accuracy on masked tokens) to each log,
  and warns when the discriminator stops separating replaced from original tokens.

Python API, for your own loop::

    generator = DisentangledForMaskedLM(generator_config(config, num_layers=6))
    discriminator = DisentangledForReplacedTokenDetection(config)
    module = ReplacedTokenDetectionPretraining(generator, discriminator, embedding_sharing="gdes", rtd_weight=10.0)
    collator = MaskingCollator(tokenizer, objective="rtd")
    loss = module(**collator(examples)).loss      # or: module(masking=collator) masks padded batches itself
    module.export_discriminator().save_pretrained("disc")   # E_G + E_delta merged into its own table
    module.generator.save_pretrained("gen")
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import Trainer
from transformers.utils import ModelOutput

from ..configuration import DisentangledConfig
from ..modeling.validation import IGNORE_INDEX
from .sequence_draws import randint, sample, token_shares, uniform

logger = logging.getLogger("disentangled.pretraining")  # the name its log lines carry (the room, not this file)

SHARING_MODES = ("gdes", "es", "none")
AUC_WARNING_MARGIN = 0.02  # |AUC - 0.5| below this after warm-up: the discriminator does not separate the tokens
WARNING_AFTER_STEPS = 100  # the collapse warning waits at least this long, even without warm-up
LEARNED_AUC = 0.6  # the run's last line: held-out ROC-AUC at least this, "the discriminator learned"


# ----------------------------------------------------------------------------------------------------------------------
# Embedding sharing


class SharedEmbedding(nn.Module):
    """The discriminator's embedding table, read in its forward from the generator's table.

    `es`: the table is E_G itself. `gdes`: sg(E_G) + E_delta, with E_delta a parameter of this module. The generator's
    module is referenced, not registered as a child, so its table is saved once, with the generator.
    """

    def __init__(self, source: nn.Embedding, mode: str, delta: Tensor | None = None):
        super().__init__()
        if mode not in ("gdes", "es"):
            raise ValueError(f"SharedEmbedding shares as 'gdes' or 'es', got {mode!r}")
        self._source = (source,)  # a tuple keeps nn.Module from registering (and saving) the generator's table twice
        self.padding_idx = source.padding_idx
        self.num_embeddings, self.embedding_dim = source.weight.shape
        if mode == "gdes":
            self.delta = nn.Parameter(torch.zeros_like(source.weight) if delta is None else delta.detach().clone())
        else:
            self.delta = None

    @property
    def source(self) -> nn.Embedding:
        return self._source[0]

    @property
    def weight(self) -> Tensor:
        if self.delta is None:
            return self.source.weight  # es: E_D = E_G
        return self.source.weight.detach() + self.delta  # gdes: E_D = sg(E_G) + E_delta

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight, self.padding_idx)

    def tables_read_elsewhere(self) -> list[tuple[nn.Module, str]]:
        """The table this forward reads from another module, and why (`integrations/sharding.py`'s FSDP check)."""
        return [(self.source, "GDES: the discriminator reads sg(E_G) + E_delta")]

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, {'sg(E_G) + E_delta' if self.delta is not None else 'E_G'}"
        )


def _shared_tables(generator: nn.Module, discriminator: nn.Module) -> list[str]:
    """Names of the embedding tables both models have, with the same shape: 'word_embeddings', 'position_embeddings'."""
    names = []
    for name in ("word_embeddings", "position_embeddings"):
        source = getattr(generator.deberta.embeddings, name, None)
        target = getattr(discriminator.deberta.embeddings, name, None)
        if source is not None and target is not None:
            names.append(name)
    return names


def check_sharing(generator_config: DisentangledConfig, config: DisentangledConfig, embedding_sharing: str) -> None:
    """Raise ValueError when the generator cannot share embeddings with the discriminator in this mode."""
    if embedding_sharing not in SHARING_MODES:
        raise ValueError(f"embedding sharing must be one of {', '.join(SHARING_MODES)}, got {embedding_sharing!r}")
    if generator_config.vocab_size != config.vocab_size:
        raise ValueError(
            f"the generator's vocabulary ({generator_config.vocab_size}) differs from the discriminator's "
            f"({config.vocab_size}); give both the same tokenizer"
        )
    if embedding_sharing == "none":
        return
    if generator_config.hidden_size > config.hidden_size:
        raise ValueError(
            f"the generator (hidden_size {generator_config.hidden_size}) is wider than the discriminator "
            f"(hidden_size {config.hidden_size}); under --embedding-sharing {embedding_sharing} it must be at most as "
            "wide: use a narrower generator or --embedding-sharing none"
        )
    if generator_config.word_embedding_size != config.word_embedding_size:
        raise ValueError(
            f"the generator's embeddings are {generator_config.word_embedding_size} wide and the discriminator's "
            f"{config.word_embedding_size}; shared tables need one width (set embedding_size) or --embedding-sharing none"
        )


def share_embeddings(
    generator: nn.Module, discriminator: nn.Module, embedding_sharing: str, keep_discriminator_tables: bool = False
) -> list[str]:
    """Make the discriminator read the generator's tables (`gdes`/`es`); returns the shared table names.

    `gdes`: E_delta starts at zero, so E_D = E_G at step 0, as in Microsoft's GDES. With `keep_discriminator_tables`
    (a discriminator loaded from a checkpoint, `--init-from`), E_delta starts as E_D - E_G instead, which keeps that
    discriminator's own tables exactly as they were.
    """
    check_sharing(generator.config, discriminator.config, embedding_sharing)
    if embedding_sharing == "none":
        return []
    names = _shared_tables(generator, discriminator)
    for name in names:
        source = getattr(generator.deberta.embeddings, name)
        own = getattr(discriminator.deberta.embeddings, name)
        with _gathered(source.weight, own.weight):
            delta = None
            if embedding_sharing == "gdes":
                delta = (own.weight - source.weight) if keep_discriminator_tables else torch.zeros_like(source.weight)
            setattr(discriminator.deberta.embeddings, name, SharedEmbedding(source, embedding_sharing, delta))
    return names


def _gathered(*parameters: nn.Parameter):
    """The whole tables for the block: `from_pretrained` under DeepSpeed ZeRO-3 (`--init-from`) leaves each process
    an empty placeholder and its partition. Nothing to do otherwise."""
    if not any(hasattr(parameter, "ds_id") for parameter in parameters):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(parameters), modifier_rank=None)


def _merged_copy(model: nn.Module) -> nn.Module:
    """A standalone copy of `model` whose shared tables are ordinary `nn.Embedding`s holding E_G (+ E_delta)."""
    state = {}
    shared = {}
    for module_name, module in model.named_modules():
        if isinstance(module, SharedEmbedding):
            shared[module_name] = module
    for key, value in model.state_dict().items():
        if not any(key.startswith(f"{name}.") for name in shared):
            state[key] = value.detach().clone()
    for name, module in shared.items():
        state[f"{name}.weight"] = module.weight.detach().clone()
    fresh = type(model)(copy.deepcopy(model.config))
    fresh.load_state_dict(state, strict=True)
    return fresh.to(next(model.parameters()).dtype).eval()


# ----------------------------------------------------------------------------------------------------------------------
# Masking


@dataclass
class MaskingCollator:
    """Picks the tokens to predict and corrupts them; as a data collator it also pads.

    `collator(examples)` takes `{"input_ids": [...]}` examples and returns `input_ids` (corrupted), `attention_mask`
    and `labels` (the original id where a token was picked, -100 elsewhere); `collator.mask(input_ids,
    attention_mask)` does the same to a padded batch on any device. Special tokens and padding are never picked.
    With `whole_word_mask`, words are picked (a word starts at a piece beginning with SentencePiece's '▁', or at a
    piece without WordPiece's '##'), all their pieces together. `objective="rtd"` replaces every picked token by
    [MASK]; `"mlm"` does 80/10/10 ([MASK] / a random token / unchanged).

    The command masks inside the objective's forward (`masking=` of the objectives, with a `PaddingCollator`): there
    the draws come after `Trainer` has restored the random state of a checkpoint, so a resumed run masks exactly as
    the uninterrupted one (Trainer fetches a resumed run's first batch before it restores that state). The command
    also gives `seed`: each sequence then draws from its own generator, seeded by the seed, the step and its tokens
    (`disentangled.pretraining.sequence_draws`), so that a run masks alike on any number of processes.
    """

    tokenizer: object
    objective: str = "mlm"
    mlm_probability: float = 0.15
    whole_word_mask: bool = False
    mask_replace_prob: float | None = None  # default: 1.0 for rtd, 0.8 for mlm
    random_replace_prob: float | None = None  # default: 0.0 for rtd, 0.1 for mlm
    seed: int | None = (
        None  # draw per sequence (disentangled.pretraining.sequence_draws): the same on any number of processes
    )
    step: int = 0  # with `seed`: the optimizer step, which PretrainingTrainer sets
    _word_starts: Tensor = field(init=False, repr=False)
    _special: Tensor = field(init=False, repr=False)
    _random_ids: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.objective not in ("rtd", "mlm"):
            raise ValueError(f"objective must be 'rtd' or 'mlm', got {self.objective!r}")
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"--mlm-probability must be between 0 and 1, got {self.mlm_probability}")
        if self.mask_replace_prob is None:
            self.mask_replace_prob = 1.0 if self.objective == "rtd" else 0.8
        if self.random_replace_prob is None:
            self.random_replace_prob = 0.0 if self.objective == "rtd" else 0.1
        if self.mask_replace_prob + self.random_replace_prob > 1.0:
            raise ValueError("mask_replace_prob + random_replace_prob must be at most 1")
        check_mask_token(self.tokenizer)
        size = len(self.tokenizer)
        pieces = [str(piece) for piece in self.tokenizer.convert_ids_to_tokens(list(range(size)))]
        special = torch.zeros(size, dtype=torch.bool)
        special[list(self.tokenizer.all_special_ids)] = True
        self._special = special
        if any(piece.startswith("▁") for piece in pieces):  # SentencePiece: a '▁' piece starts a word
            self._word_starts = torch.tensor([piece.startswith("▁") for piece in pieces])
        else:  # WordPiece: a '##' piece continues one
            self._word_starts = torch.tensor([not piece.startswith("##") for piece in pieces])
        self._random_ids = (~special).nonzero().flatten()

    def __call__(self, examples: list[dict]) -> dict[str, Tensor]:
        batch = PaddingCollator(self.tokenizer)(examples)
        batch["input_ids"], batch["labels"] = self.mask(batch["input_ids"], batch["attention_mask"])
        return batch

    def mask(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(corrupted input_ids, labels) for a padded [B, L] batch, on its device."""
        device = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        picked = self._pick(input_ids, attention_mask)
        labels = torch.where(picked, input_ids, IGNORE_INDEX)
        draw = self.uniform(input_ids, attention_mask, "replace")
        to_mask = picked & (draw < self.mask_replace_prob)
        to_random = picked & ~to_mask & (draw < self.mask_replace_prob + self.random_replace_prob)
        random_ids = self._random_ids.to(device)
        if self.seed is None:
            random_ids = random_ids[torch.randint(len(random_ids), input_ids.shape, device=device)]
        else:
            random_ids = random_ids[randint(len(random_ids), input_ids, attention_mask, self.seed, self.step, "random")]
        corrupted = torch.where(to_mask, self.tokenizer.mask_token_id, input_ids)
        corrupted = torch.where(to_random, random_ids, corrupted)
        return corrupted, labels

    def uniform(self, input_ids: Tensor, attention_mask: Tensor, stream: str) -> Tensor:
        """[B, L] draws in [0, 1): torch's generator, or with `seed` each sequence's own (`stream` names the use)."""
        if self.seed is None:
            return torch.rand(input_ids.shape, device=input_ids.device)
        return uniform(input_ids, attention_mask, self.seed, self.step, stream)

    def _pick(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """[B, L] bool: the tokens to predict."""
        device = input_ids.device
        candidate = ~self._special.to(device)[input_ids] & attention_mask.bool()
        draw = self.uniform(input_ids, attention_mask, "pick") < self.mlm_probability
        if not self.whole_word_mask:
            return candidate & draw
        starts = self._word_starts.to(device)[input_ids] | ~candidate  # special tokens and padding end a word
        word = starts.long().cumsum(-1)  # [B, L]: index of each token's word
        word_picked = torch.zeros(input_ids.shape[0], input_ids.shape[1] + 1, dtype=torch.bool, device=device)
        rows = torch.arange(input_ids.shape[0], device=device).unsqueeze(-1).expand_as(input_ids)
        word_picked[rows[starts], word[starts]] = draw[starts]  # one draw per word, at its first piece
        return word_picked.gather(-1, word) & candidate


@dataclass
class PaddingCollator:
    """Pads `{"input_ids": [...]}` examples to the longest: `input_ids`, `attention_mask`."""

    tokenizer: object

    def __call__(self, examples: list[dict]) -> dict[str, Tensor]:
        sequences = [example["input_ids"] for example in examples]
        length = max(len(sequence) for sequence in sequences)
        input_ids = torch.full((len(sequences), length), self.tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            input_ids[row, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
            attention_mask[row, : len(sequence)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}


def check_mask_token(tokenizer) -> None:
    mask = tokenizer.mask_token
    if mask is None or tokenizer.mask_token_id is None or tokenizer.mask_token_id == tokenizer.unk_token_id:
        raise ValueError(
            "the tokenizer has no [MASK] token, which masked-token pretraining needs: use a DeBERTa tokenizer "
            "(spm.model) or add one with tokenizer.add_special_tokens({'mask_token': '[MASK]'})"
        )


# ----------------------------------------------------------------------------------------------------------------------
# Metrics


class PretrainingMetrics:
    """Running sums since the last log (losses, generator accuracy on masked tokens, the discriminator's confusion
    counts) and the discriminator's logit and label for every labelled token, for its exact ROC-AUC. Gathered over
    processes when read."""

    NAMES = (
        "steps", "generator_loss", "discriminator_loss", "masked", "masked_correct",
        "true_positive", "false_positive", "false_negative", "replaced", "labelled",
    )  # fmt: skip

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.scores: list[Tensor] = []  # the discriminator's logits on labelled tokens, one tensor per step
        self.labels: list[Tensor] = []  # 1 replaced, 0 original, beside `scores`

    def reset(self) -> None:
        self.sums, self.scores, self.labels = {}, [], []

    def state(self) -> tuple:
        return self.sums, self.scores, self.labels

    def restore(self, state: tuple) -> None:
        self.sums, self.scores, self.labels = state

    def _add(self, name: str, value: Tensor) -> None:
        value = value.detach().double()
        self.sums[name] = self.sums[name] + value if name in self.sums else value

    @torch.no_grad()
    def update_generator(self, loss: Tensor, logits: Tensor, labels: Tensor) -> None:
        """`logits` [B, L, V], or [M, V] at the M masked tokens (`sparse_prediction`)."""
        picked = labels != IGNORE_INDEX
        predicted = logits.argmax(-1)
        correct = (predicted == labels[picked]) if predicted.dim() == 1 else (predicted == labels) & picked
        self._add("steps", torch.ones((), device=labels.device))
        self._add("generator_loss", loss)
        self._add("masked", picked.sum())
        self._add("masked_correct", correct.sum())

    @torch.no_grad()
    def update_discriminator(self, loss: Tensor, logits: Tensor, labels: Tensor) -> None:
        keep = labels != IGNORE_INDEX
        scores, replaced = logits[keep].float(), labels[keep] == 1
        predicted = scores > 0  # probability > 0.5
        self._add("discriminator_loss", loss)
        self._add("true_positive", (predicted & replaced).sum())
        self._add("false_positive", (predicted & ~replaced).sum())
        self._add("false_negative", (~predicted & replaced).sum())
        self._add("replaced", replaced.sum())
        self._add("labelled", keep.sum())
        self.scores.append(scores)
        self.labels.append(replaced.to(torch.int8))

    def compute(self) -> dict[str, float]:
        """The metrics since the last reset, over all processes; resets. Empty when nothing was recorded."""
        names = [name for name in self.NAMES if name in self.sums]
        if not names:
            return {}
        values = torch.stack([self.sums[name] for name in names])
        scores = torch.cat(self.scores) if self.scores else None
        labels = torch.cat(self.labels) if self.labels else None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(values)
            if scores is not None:
                scores, labels = gather_variable(scores), gather_variable(labels)
        sums = dict(zip(names, values.tolist()))
        self.reset()
        steps = max(sums.pop("steps", 0.0), 1.0)
        metrics = {}
        for name in ("generator_loss", "discriminator_loss"):
            if name in sums:
                metrics[name] = sums[name] / steps
        if "masked" in sums:
            metrics["generator_accuracy"] = sums["masked_correct"] / max(sums["masked"], 1.0)
        if "labelled" in sums:
            true_positive = sums["true_positive"]
            metrics["discriminator_precision"] = true_positive / max(true_positive + sums["false_positive"], 1.0)
            metrics["discriminator_recall"] = true_positive / max(true_positive + sums["false_negative"], 1.0)
            metrics["replaced_fraction"] = sums["replaced"] / max(sums["labelled"], 1.0)
            metrics["discriminator_auc"] = roc_auc(scores, labels) if scores is not None else float("nan")
        return {name: round(value, 4) if math.isfinite(value) else value for name, value in metrics.items()}


def gather_variable(values: Tensor) -> Tensor:
    """Every process's 1-d `values` (their lengths may differ), concatenated in rank order, on every process."""
    size = torch.tensor([values.numel()], device=values.device)
    sizes = [torch.zeros_like(size) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(sizes, size)
    longest = int(max(sizes).item())
    padded = torch.zeros(longest, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    gathered = [torch.zeros_like(padded) for _ in sizes]
    torch.distributed.all_gather(gathered, padded)
    return torch.cat([part[: int(count.item())] for part, count in zip(gathered, sizes)])


def roc_auc(scores: Tensor, labels: Tensor) -> float:
    """Exact ROC-AUC: P(score of a positive > score of a negative), a tie counting half; NaN without both classes.

    Mann-Whitney: AUC = (R+ - n+ (n+ + 1) / 2) / (n+ n-), with R+ the sum of the positives' ranks among all scores,
    tied scores sharing their average rank.
    """
    scores, positive = scores.detach().double().flatten().cpu(), labels.detach().flatten().cpu().bool()
    positives, negatives = int(positive.sum()), int((~positive).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    _, inverse, counts = torch.unique(scores, sorted=True, return_inverse=True, return_counts=True)
    last_rank = counts.cumsum(0).double()  # the 1-based rank of the last score in each group of equal scores
    average_rank = last_rank - (counts.double() - 1) / 2
    rank_sum = average_rank[inverse][positive].sum()
    return float((rank_sum - positives * (positives + 1) / 2) / (positives * negatives))


@torch.no_grad()
def random_replacement_auc(
    discriminator: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    replaceable: Tensor,
    probability: float = 0.15,
    seed: int = 0,
    batch_size: int = 64,
) -> float:
    """The discriminator's exact ROC-AUC on held-out sequences in which `probability` of the ordinary tokens are
    replaced by tokens drawn uniformly from `replaceable` (ids): the easiest replacements there are, the same for
    every run, whatever the generator learned. Special tokens and padding are neither replaced nor scored."""
    draws = torch.Generator().manual_seed(seed)
    replace_table = torch.zeros(int(max(replaceable.max(), input_ids.max())) + 1, dtype=torch.bool)
    replace_table[replaceable] = True
    ordinary = replace_table[input_ids] & attention_mask.bool()
    chosen = ordinary & (torch.rand(input_ids.shape, generator=draws) < probability)
    drawn = replaceable[torch.randint(len(replaceable), input_ids.shape, generator=draws)]
    corrupted = torch.where(chosen, drawn, input_ids)
    labels = (corrupted != input_ids).long()
    training = discriminator.training
    discriminator.eval()
    device = next(discriminator.parameters()).device
    scores = []
    for start in range(0, len(corrupted), batch_size):
        rows = slice(start, start + batch_size)
        logits = discriminator(input_ids=corrupted[rows].to(device), attention_mask=attention_mask[rows].to(device))
        scores.append(logits.logits.float().cpu())
    discriminator.train(training)
    scored = ordinary  # a replaced token, or an ordinary one left in place
    return roc_auc(torch.cat(scores)[scored], labels[scored])


# ----------------------------------------------------------------------------------------------------------------------
# Objectives


@dataclass
class PretrainingOutput(ModelOutput):
    """`loss` is what `Trainer` optimises; the rest is detached, for logs and your own loop."""

    loss: Tensor | None = None
    generator_loss: Tensor | None = None
    discriminator_loss: Tensor | None = None
    generator_logits: Tensor | None = None  # [M, V] at the M masked tokens (labels != -100), in row-major order
    discriminator_logits: Tensor | None = None
    discriminator_labels: Tensor | None = None
    discriminator_input_ids: Tensor | None = None


def generator_config(config: DisentangledConfig, num_layers: int | None = None) -> DisentangledConfig:
    """The generator for `config`'s discriminator: same width, `num_layers` (default half the depth), with the
    Enhanced Mask Decoder and DeBERTa-v3's MLM head layout, as Microsoft's generators have them."""
    num_layers = max(1, config.num_hidden_layers // 2) if num_layers is None else num_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"--generator-layers must be a positive integer, got {num_layers!r}")
    generator = copy.deepcopy(config)
    generator.num_hidden_layers = num_layers
    generator.enhanced_mask_decoder = True
    generator.legacy = False
    generator.architectures = None
    return generator


class ReplacedTokenDetectionPretraining(nn.Module):
    """Generator (`DisentangledForMaskedLM`) and discriminator (`DisentangledForReplacedTokenDetection`) as one module.

    `forward(input_ids, attention_mask, labels)` takes the collator's output (`objective="rtd"`): `input_ids` with the
    picked tokens replaced by [MASK], `labels` the original ids there (-100 elsewhere).
    """

    def __init__(
        self,
        generator: nn.Module,
        discriminator: nn.Module,
        embedding_sharing: str = "gdes",
        rtd_weight: float = 10.0,
        masking: MaskingCollator | None = None,
        keep_discriminator_tables: bool = False,
        global_token_mean: bool = False,
    ):
        super().__init__()
        self.masking = masking
        self.global_token_mean = global_token_mean  # each loss a mean over all processes' tokens (sequence_draws)
        if not math.isfinite(rtd_weight) or rtd_weight <= 0:
            raise ValueError(f"--rtd-weight must be a positive number, got {rtd_weight}")
        self.generator = generator
        self.discriminator = discriminator
        self.embedding_sharing = embedding_sharing
        self.rtd_weight = rtd_weight
        self.shared_tables = share_embeddings(generator, discriminator, embedding_sharing, keep_discriminator_tables)
        self.metrics = PretrainingMetrics()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> PretrainingOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if labels is None:  # an unmasked batch: mask it here
            if self.masking is None:
                raise ValueError("give `labels` (the original ids of masked tokens, -100 elsewhere) or `masking=`")
            input_ids, labels = self.masking.mask(input_ids, attention_mask)
        # the generator's head only at the masked tokens: logits [M, V], not [B, L, V]
        generated = self.generator(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            labels=labels,
            sparse_prediction=True,
        )
        masked = labels != IGNORE_INDEX
        original = torch.where(masked, labels, input_ids)
        with torch.no_grad():  # sample at temperature 1; no gradient flows through the sampling
            if self.masking is not None and self.masking.seed is not None:  # per sequence, as the masking
                draws = self.masking.uniform(original, attention_mask, "sample")[masked]  # [M]
            else:
                draws = torch.rand(generated.logits.shape[0], device=labels.device)
            corrupted = original.clone()
            corrupted[masked] = sample(generated.logits.detach(), draws)  # multinomial over softmax(logits)
            rtd_labels = (corrupted != original).long()  # a sample equal to the original is original
            rtd_labels = rtd_labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
        detected = self.discriminator(
            input_ids=corrupted, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=rtd_labels
        )
        loss = generated.loss + self.rtd_weight * detected.loss  # L_MLM + lambda * L_RTD
        if self.global_token_mean:  # the same, as this process's part of the means over every process's tokens
            generator_share, discriminator_share = token_shares(masked.sum(), (rtd_labels != IGNORE_INDEX).sum())
            loss = generated.loss * generator_share + self.rtd_weight * detected.loss * discriminator_share
        self.metrics.update_generator(generated.loss, generated.logits, labels)
        self.metrics.update_discriminator(detected.loss, detected.logits, rtd_labels)
        return PretrainingOutput(
            loss=loss,
            generator_loss=generated.loss.detach(),
            discriminator_loss=detected.loss.detach(),
            generator_logits=generated.logits.detach(),
            discriminator_logits=detected.logits.detach(),
            discriminator_labels=rtd_labels,
            discriminator_input_ids=corrupted,
        )

    def activation_checkpointing_enable(self, **kwargs) -> None:
        """`--activation_checkpointing` (`--gradient_checkpointing`): both models recompute their layers' activations
        in the backward pass."""
        for model in (self.generator, self.discriminator):
            model.activation_checkpointing_enable(**kwargs)

    def gradient_checkpointing_enable(self, **kwargs) -> None:  # the name transformers 4.x calls
        for model in (self.generator, self.discriminator):
            model.gradient_checkpointing_enable(**kwargs)

    def export_discriminator(self) -> nn.Module:
        """The discriminator as an ordinary model: E_G + E_delta (gdes) or E_G (es) merged into its own tables."""
        return _merged_copy(self.discriminator)

    def export_generator(self) -> nn.Module:
        return self.generator


class MaskedLMPretraining(nn.Module):
    """The MLM objective around a `DisentangledForMaskedLM`: its loss, and the accuracy on masked tokens logged."""

    def __init__(self, model: nn.Module, masking: MaskingCollator | None = None, global_token_mean: bool = False):
        super().__init__()
        self.model = model
        self.masking = masking
        self.global_token_mean = global_token_mean  # the loss a mean over all processes' masked tokens
        self.metrics = PretrainingMetrics()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> PretrainingOutput:
        if labels is None and self.masking is not None:  # an unmasked batch: mask it here
            input_ids, labels = self.masking.mask(input_ids, attention_mask)
        output = self.model(  # with labels, logits only at the masked tokens: [M, V]
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            labels=labels,
            sparse_prediction=labels is not None,
        )
        loss = output.loss
        if labels is not None:
            self.metrics.update_generator(output.loss, output.logits, labels)
            if self.global_token_mean:
                loss = loss * token_shares((labels != IGNORE_INDEX).sum())[0]
        return PretrainingOutput(
            loss=loss,
            generator_loss=None if output.loss is None else output.loss.detach(),
            generator_logits=output.logits.detach(),
        )

    def activation_checkpointing_enable(self, **kwargs) -> None:
        self.model.activation_checkpointing_enable(**kwargs)

    def gradient_checkpointing_enable(self, **kwargs) -> None:  # the name transformers 4.x calls
        self.model.gradient_checkpointing_enable(**kwargs)

    def export_model(self) -> nn.Module:
        return self.model


# ----------------------------------------------------------------------------------------------------------------------
# Trainer


class PretrainingTrainer(Trainer):
    """`Trainer` whose training and evaluation logs carry the objective's metrics (see `PretrainingMetrics`).

    MLM logs `generator_loss` / `generator_accuracy` for its model. A discriminator whose ROC-AUC is within 0.02 of
    0.5 after the learning-rate warm-up (and at least a fifth of the run, and 100 steps) is reported with a warning:
    it does not separate replaced tokens.
    """

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        metrics = self.model.metrics if hasattr(self.model, "metrics") else None
        # a training log has "loss"; an evaluation's has "<prefix>_loss" (eval_, held_out_, ...); the run's summary
        # ("train_loss") has no metrics of its own
        prefix = (
            "" if "loss" in logs else next((k[:-4] for k in logs if k.endswith("_loss") and k != "train_loss"), None)
        )
        if metrics is not None and prefix is not None:
            values = metrics.compute()
            if isinstance(self.model, MaskedLMPretraining):
                values = {("mlm_loss" if k == "generator_loss" else k): v for k, v in values.items()}
                values = {("masked_accuracy" if k == "generator_accuracy" else k): v for k, v in values.items()}
            logs.update({prefix + name: value for name, value in values.items()})
            self._check_discriminator(values.get("discriminator_auc"), prefix)
        super().log(logs, *args, **kwargs)

    def _check_discriminator(self, auc: float | None, prefix: str) -> None:
        if auc is None or not math.isfinite(auc) or prefix:
            return
        max_steps = self.state.max_steps or 0
        warmup = self.args.get_warmup_steps(max_steps) if max_steps else 0
        # after a real warm-up: the schedule's, and never before a fifth of the run or WARNING_AFTER_STEPS steps
        after = max(warmup, max_steps // 5, WARNING_AFTER_STEPS)
        if self.state.global_step > after and abs(auc - 0.5) < AUC_WARNING_MARGIN:
            logger.warning(
                "step %d: the discriminator's ROC-AUC is %.3f, near 0.5 after warm-up: it does not separate replaced "
                "from original tokens (try a lower learning rate, or see docs/pretraining.md)",
                self.state.global_step,
                auc,
            )

    def compute_loss(self, model, inputs, *args, **kwargs):
        masking = getattr(self.model, "masking", None)
        if masking is not None:
            masking.step = self.state.global_step  # per-sequence draws change from step to step
        return super().compute_loss(model, inputs, *args, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The objective's loss (it masks unmasked batches itself, so `labels` need not be in the batch); the
        metrics come from the objective's running sums."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def evaluate(self, *args, **kwargs):
        metrics = getattr(self.model, "metrics", None)
        saved = None if metrics is None else metrics.state()
        if metrics is not None:
            metrics.reset()  # training sums since the last log wait until evaluation is over
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            if metrics is not None:
                metrics.restore(saved)
