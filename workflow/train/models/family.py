"""Model families (config model.family): what differs between BERT, ModernBERT and RoBERTa, each named in one place.

A family reads its model config (a preset with `model.architecture` over it, a config file, or an HF directory to
start from), builds the pretraining model, says what defines its math (the fingerprint), counts its FLOPs, prepares
a batch's indices on the host and writes its exports. The engine, the data half and the pretraining task call either
the same way; the models themselves are workflow/train/models/bert.py (BERT), modernbert.py and roberta.py (RoBERTa
and XLM-R, on BERT's encoder).

API:
    family(name) -> Family               "bert" (NVIDIA's recipe, the default) | "modernbert" | "roberta"
    model_config_error(config) -> line | None   the model section and encode.objective checked (the Snakefile, at
                                         parse time: this module imports torch only when a model is built)
    ModelSettings.from_config(model)     the config's model section (family, preset, architecture, bert_config,
                                         init_from, dle_gelu), a key that does not apply to the family refused
    Family.build(m, vocab, vocab_size, seq_length) -> (config, model)   the pretraining model
    Family.check_objective(objective)    the data's objective (encode.objective), refused where the family lacks it
    Family.fingerprint(config), .flops_per_sequence(config, seq_length, max_predictions), .host_indices(batch)
    Family.pretraining_model(config), .trains_unpadded(device_type, packed, precision) (.unpads(packed,
                                         precision) on a varlen device), .unpads_in_fp32
                                         (the cluster check's), .positions(config) (the longest sequence it takes)
    Family.reads_dle_checkpoints, .has_rotary_theta   which model keys apply (check_settings refuses the rest)
    Family.heads, .head_parts           the fine-tuning heads it has (kinds of workflow/train/models/heads.py:
                                         QuestionAnswering, SequenceClassification, TokenClassification) and its
                                         model module's HEAD_PARTS (its encoder and layers under HF's names)
    Family.export(model, config, vocab, directory, normalization, next_sentence_prediction, dle_gelu)
Fine-tuning (any HF directory; its model type picks the family, whatever model.family says):
    directory_family(directory) -> Family    by config.json's model_type (Family.model_types; modernbert: ModernBERT,
                                         Ettin, mmBERT; roberta, xlm-roberta: RoBERTa's; else BERT's)
    Family.load_directory(directory) -> (config, state)   the config and weights a fine-tuning head starts from
    Family.save_directory(model, config, vocab, directory, normalization)   a fine-tuned head's HF directory
    Family.rows_host_indices(batch) -> batch   a fine-tuning batch's indices (ModernBERT: its rows' sequences)
    own_vocab(directory) -> its vocab.txt or tokenizer.json (None: neither)
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
from dataclasses import dataclass
from pathlib import Path

from workflow.cli import UserError
from workflow.config import PHASES, schema_defaults

log = logging.getLogger("family")
# Each family's presets (its model module's _PRESETS), the first its default.
PRESETS = {"bert": ("bert-large", "bert-base", "tiny"),
           "modernbert": ("modernbert-base", "modernbert-large", "modernbert-tiny"),
           "roberta": ("roberta-base", "roberta-large", "roberta-tiny")}


@dataclass(frozen=True)
class ModelSettings:
    """The config's model section as a family reads it, for one phase (no defaults here: the schema's,
    through from_config)."""

    family: str
    preset: str | None                  # None: the family's first PRESETS entry
    architecture: dict                  # HF config keys over the preset
    bert_config: str | None             # BERT: a Google bert_config.json (or the DLE checkpoint's)
    init_from: str | None               # where the phase starts: model.init_from, or the previous phase's export
    dle_gelu: str
    global_rope_theta: float | None     # ModernBERT: the phase's global rotary theta (context extension)
    phase: str

    @classmethod
    def from_config(cls, model: dict, init_from: str | None = None, global_rope_theta: float | None = None,
                    phase: str = PHASES[0]) -> "ModelSettings":
        """`model`: the config's model section (a key it leaves out: the schema's default); `init_from`: where this
        phase starts (phase 2: phase 1's export), else model.init_from; `global_rope_theta`: config
        pretrain.<phase>.global_rope_theta. A key that does not apply to the family is refused."""
        model = {**schema_defaults("model"), **model}
        settings = cls(family=model["family"], preset=model["preset"], architecture=dict(model["architecture"]),
                       bert_config=model["bert_config"], init_from=init_from or model["init_from"],
                       dle_gelu=model["dle_gelu"], global_rope_theta=global_rope_theta, phase=phase)
        given = model["init_from"] or settings.bert_config
        if settings.architecture and given:
            raise UserError(f"config model.architecture {settings.architecture}: the model comes from {given} "
                            "(model.init_from or model.bert_config), whose config it would contradict; set one or "
                            "the other")
        family(settings.family).check_settings(settings)
        return settings

    @property
    def preset_name(self) -> str:
        return self.preset or PRESETS[self.family][0]


def model_config_error(config: dict) -> str | None:
    """The workflow config's model section (and the data's objective) as the phases will read them: the one error
    line, None when they fit."""
    try:
        for phase in PHASES:
            theta = config.get("pretrain", {}).get(phase, {}).get("global_rope_theta")
            settings = ModelSettings.from_config(config["model"], global_rope_theta=theta, phase=phase)
        family(settings.family).check_objective(config["encode"]["objective"])
    except UserError as error:
        return str(error)
    return None


def check_same_vocab(init_from: str, rows: int, vocab_size: int, vocab: str | None, padded_rows: bool = False) -> None:
    """Continuing a model needs the data tokenized with its own vocab: as many entries (its rows, or those rows
    padded to a multiple of 8 as DLE and our presets do; with `padded_rows`, any number of rows from the vocab's size
    up: ModernBERT pads its 50,280 tokens to 50,368 rows) and, where the model has a vocab.txt or tokenizer.json, the
    same tokens."""
    if rows not in (vocab_size, (vocab_size + 7) // 8 * 8) and not (padded_rows and rows >= vocab_size):
        raise UserError(f"model.init_from {init_from}: a vocabulary of {rows} entries, the data's has {vocab_size}: "
                        "tokenize the data with the model's own vocab (vocab.file) or start from random weights "
                        "(model.init_from: null)")
    from workflow.data.tokenizer import vocab_tokens

    own = own_vocab(init_from)
    if vocab and own and vocab_tokens(own) != vocab_tokens(vocab):
        raise UserError(f"model.init_from {init_from}: its {own.name} differs from the data's {vocab}: tokenize the "
                        f"data with it (vocab.file: {own}) or start from random weights (model.init_from: null)")


def own_vocab(directory: str | Path) -> Path | None:
    """An HF directory's vocab file (vocab.txt or tokenizer.json), None when it has neither."""
    from workflow.data.vocab import VOCAB_FILES

    return next((Path(directory) / name for name in VOCAB_FILES.values() if (Path(directory) / name).is_file()), None)


def _check_sizes(config, source: str, vocab_size: int, seq_length: int, positions: int) -> None:
    if config.vocab_size < vocab_size:
        raise UserError(f"{source}: vocab_size {config.vocab_size} is smaller than the vocabulary ({vocab_size})")
    if positions < seq_length:
        usable = "" if positions == config.max_position_embeddings else f" ({positions} past the padding index)"
        raise UserError(f"{source}: max_position_embeddings {config.max_position_embeddings}{usable} < sequence "
                        f"length {seq_length} of the data")


def _special_ids(vocab: str | None, roles: dict) -> dict:
    """The config's special-token ids (config key -> the token's role) as the data's vocab has them (none without)."""
    if not vocab:
        return {}
    from workflow.data.tokenizer import Vocabulary

    ids = Vocabulary.load(vocab).special_ids
    return {key: ids[role] for key, role in roles.items()}


def _preset(config_class, m: ModelSettings, **sized):
    """The preset with `model.architecture` over it (a key the family's config lacks is refused)."""
    names = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(m.architecture) - names)
    if unknown:
        raise UserError(f"config model.architecture: {', '.join(unknown)} not a key of a {m.family} config (one of "
                        f"{', '.join(sorted(names))})")
    return config_class.preset(m.preset_name, **{**m.architecture, **sized})


def _load_weights(model, state: dict, init_from: str) -> None:
    """`state` into `model`. Heads the weights lack (a bare encoder's masked-LM head, a masked-LM model's pooler and
    next-sentence head) start freshly initialised, as HF's from_pretrained starts them; an encoder tensor they lack
    is refused: the phase would continue from random weights."""
    from workflow.train.models.kit import load_weights

    missing, unexpected = load_weights(model, state)
    encoder = model.base_model_prefix + "."
    lacking = [key for key in missing if key.startswith(encoder) and not key.startswith(encoder + "pooler.")]
    if lacking:
        raise UserError(f"model.init_from {init_from}: its weights lack {len(lacking)} of the encoder's tensors, e.g. "
                        f"{lacking[0]} (it has {len(state)}, e.g. {next(iter(state), 'none')}): start from a "
                        "directory of the whole model, or from random weights (model.init_from: null)")
    log.info("initialised from %s (%d tensors)", init_from, len(state))
    if missing or unexpected:
        log.warning("init_from %s: missing %s, unexpected %s (kept freshly initialised)", init_from, missing,
                    unexpected)


class _Family:
    """What the families do alike, through the family's model module (imported when first needed: the Snakefile
    reads this module at parse time without torch), and the capabilities that tell them apart."""

    name: str               # config model.family
    display_name: str       # as a message names the model
    model_types: tuple      # the config.json model_types of its HF directories
    module_name: str        # the family's model module
    config_name: str        # its config class
    pretraining_name: str   # its pretraining model class
    objectives = ("full_sentences", "documents")  # the encode.objective values it trains on (nsp: a next-sentence head)
    reads_dle_checkpoints = False  # model.bert_config, model.dle_gelu and a DLE checkpoint file as model.init_from
    has_rotary_theta = False       # pretrain.<phase>.global_rope_theta
    # the fine-tuning heads of its exports (SQuAD: QuestionAnswering; GLUE and the tasks: SequenceClassification,
    # TokenClassification), built from its model module's HEAD_PARTS
    heads = ("QuestionAnswering", "SequenceClassification", "TokenClassification")
    unpads_in_fp32 = True   # its unpadded path (BERT's encoder: nested tensors) runs in any precision, on CPU too

    @property
    def module(self):
        return importlib.import_module(self.module_name)

    @property
    def config_class(self):
        return getattr(self.module, self.config_name)

    @property
    def head_parts(self):
        """The fine-tuning heads' parts (workflow/train/models/heads.py)."""
        return self.module.HEAD_PARTS

    def pretraining_model(self, config):
        return getattr(self.module, self.pretraining_name)(config)

    def host_indices(self, batch: dict) -> dict:
        return self.module.host_indices(batch)

    def positions(self, config) -> int:
        """The longest sequence the model takes."""
        return config.max_position_embeddings

    def _checked_model(self, config, state: dict | None, source: str, vocab_size: int, seq_length: int):
        """The pretraining model of `config`, which must fit the data's vocab and length, with `state` (the weights
        of `source`) loaded when given."""
        _check_sizes(config, source, vocab_size, seq_length, self.positions(config))
        model = self.pretraining_model(config)
        if state is not None:
            _load_weights(model, state, source)
        return model

    def flops_per_sequence(self, config, seq_length: int, max_predictions: float) -> float:
        return self.module.flops_per_sequence(config, seq_length, max_predictions)

    def fingerprint(self, config) -> dict:
        return {"model family": self.name, "model": config.to_dict()}

    @staticmethod
    def rows_host_indices(batch: dict) -> dict:
        return batch

    def trains_unpadded(self, device_type: str, packed: bool, precision: str) -> bool:
        """Whether batches run unpadded (the varlen kernels) on `device_type`: on the devices of
        kit.VARLEN_DEVICE_TYPES, as unpads() says."""
        from workflow.train.models.kit import VARLEN_DEVICE_TYPES

        return device_type in VARLEN_DEVICE_TYPES and self.unpads(packed, precision)

    @staticmethod
    def unpads(packed: bool, precision: str) -> bool:
        """Whether batches run unpadded on a varlen device (torch-free: the head's floor check asks it): packed rows,
        in any precision."""
        return packed

    def check_objective(self, objective: str) -> None:
        if objective not in self.objectives:
            raise UserError(f"encode.objective {objective}: model.family {self.name} has no next-sentence head; "
                            f"encode the data with encode.objective: {' or '.join(self.objectives)}")

    def check_settings(self, m: ModelSettings) -> None:
        """The model keys that apply to this family; another family's key refused in one line naming who takes it."""
        if m.preset_name not in PRESETS[self.name]:
            owner = next((name for name, presets in PRESETS.items() if m.preset_name in presets), None)
            hint = f"; a {FAMILIES[owner].display_name} preset needs model.family: {owner}" if owner else ""
            raise UserError(f"config model.preset: {m.preset_name!r} is not a {self.name} preset (one of "
                            f"{', '.join(PRESETS[self.name])}){hint}")
        if m.global_rope_theta is not None and not self.has_rotary_theta:
            raise UserError(f"config pretrain.{m.phase}.global_rope_theta: {self.display_name} has learned positions, "
                            f"no rotary theta; it applies to model.family: {_families_with('has_rotary_theta')}")
        if self.reads_dle_checkpoints:
            return
        dle = f"NVIDIA DLE checkpoints are read by model.family: {_families_with('reads_dle_checkpoints')}"
        if m.bert_config:
            raise UserError(f"config model.bert_config: a BERT config file does not apply to model.family: {self.name} "
                            "(set model.preset and model.architecture, or start from an HF directory with "
                            f"model.init_from); {dle}")
        if m.dle_gelu != schema_defaults("model")["dle_gelu"]:
            raise UserError(f"config model.dle_gelu: {dle}; it does not apply to model.family: {self.name}")
        if m.init_from and not Path(m.init_from).is_dir():
            raise UserError(f"model.init_from {m.init_from}: model.family {self.name} starts from a Hugging Face "
                            f"{self.display_name} directory (config.json, model.safetensors), not a file ({dle})")


class BertFamily(_Family):
    """NVIDIA's BERT (workflow/train/models/bert.py): NSP or not, DLE checkpoints in and out."""

    name, display_name, model_types = "bert", "BERT", ("bert",)
    module_name, config_name, pretraining_name = "workflow.train.models.bert", "BertConfig", "BertForPreTraining"
    objectives = ("nsp", "full_sentences", "documents")
    special_token_roles = {"pad_token_id": "pad"}  # BERT's vocab: 0, the config's default (its fingerprint unchanged)
    reads_dle_checkpoints = True

    @staticmethod
    def load_directory(directory):
        from workflow.train.models.bert import load_pretrained

        return load_pretrained(directory)

    @staticmethod
    def save_directory(model, config, vocab, directory, normalization) -> None:
        from workflow.train.models.bert import save_pretrained

        save_pretrained(model, config, vocab, directory, normalization)

    def build(self, m: ModelSettings, vocab: str | None, vocab_size: int, seq_length: int):
        """Model from (in order of precedence) an HF directory or a DLE checkpoint (with its bert_config.json), a
        bert_config.json, or a preset sized to the vocab; the latter two with the vocab's padding id."""
        from workflow.train.models import bert as bert
        from workflow.train.models.dle_checkpoint import load_checkpoint

        state = None
        if m.init_from:
            config, state = load_checkpoint(m.init_from, m.bert_config, gelu=m.dle_gelu)
            source = m.init_from
            check_same_vocab(m.init_from, config.vocab_size, vocab_size, vocab)
        elif m.bert_config:  # a Google bert_config.json names no padding id: the data's
            config = dataclasses.replace(bert.BertConfig.from_json(m.bert_config),
                                         **_special_ids(vocab, self.special_token_roles))
            source = m.bert_config
        else:  # the vocab padded to a multiple of 8 (tensor-core friendly), as NVIDIA does
            config = _preset(bert.BertConfig, m, vocab_size=(vocab_size + 7) // 8 * 8,
                             **_special_ids(vocab, self.special_token_roles))
            source = f"preset {m.preset_name}"
        return config, self._checked_model(config, state, source, vocab_size, seq_length)

    def fingerprint(self, config) -> dict:
        return {"model": config.to_dict()}  # without the family's name: BERT's fingerprints as before families

    def export(self, model, config, vocab, directory, normalization, next_sentence_prediction: bool,
               dle_gelu: str) -> None:
        from workflow.train.models.dle_checkpoint import save_dle_export
        from workflow.train.models.bert import save_pretrained

        save_pretrained(model, config, vocab, directory, normalization=normalization,
                        next_sentence_prediction=next_sentence_prediction)
        save_dle_export(model, directory, gelu=dle_gelu)


class ModernBertFamily(_Family):
    """ModernBERT (workflow/train/models/modernbert.py): masked LM only, HF directories in and out."""

    name, display_name, model_types = "modernbert", "ModernBERT", ("modernbert",)
    module_name, config_name, pretraining_name = ("workflow.train.models.modernbert", "ModernBertConfig",
                                                  "ModernBertForMaskedLM")
    has_rotary_theta = True
    unpads_in_fp32 = False  # flash kernels only: 16-bit, CUDA
    special_token_roles = {"pad_token_id": "pad", "cls_token_id": "cls", "bos_token_id": "cls", "sep_token_id": "sep",
                           "eos_token_id": "sep"}

    @staticmethod
    def load_directory(directory):
        return load_pretrained(directory, key=None)

    @staticmethod
    def save_directory(model, config, vocab, directory, normalization) -> None:
        save_pretrained(model, config, vocab, directory)  # a BPE tokenizer.json: no normalisation to write

    @staticmethod
    def rows_host_indices(batch: dict) -> dict:
        """The sequences of a fine-tuning batch's rows (model.UNPADDED_KEYS), found on the host: this family runs
        every batch unpadded on the devices of model.VARLEN_DEVICE_TYPES."""
        from workflow.train.models.kit import UNPADDED_KEYS, unpad

        return {**batch, **dict(zip(UNPADDED_KEYS, unpad(batch["attention_mask"], 1)))}

    @staticmethod
    def unpads(packed: bool, precision: str) -> bool:
        """Every batch, in a 16-bit precision (the flash kernels'); fp32 runs rows with masks."""
        return precision in ("bf16", "fp16")

    def build(self, m: ModelSettings, vocab: str | None, vocab_size: int, seq_length: int):
        """Model from an HF ModernBERT directory (ModernBERT's, Ettin's, mmBERT's) or a preset sized to the vocab,
        with the vocab's special ids."""
        from workflow.train.models import modernbert

        if m.init_from:
            config, state = load_pretrained(m.init_from)
            check_same_vocab(m.init_from, config.vocab_size, vocab_size, vocab, padded_rows=True)
            source = m.init_from
        else:
            config = _preset(modernbert.ModernBertConfig, m, vocab_size=(vocab_size + 7) // 8 * 8,
                             **_special_ids(vocab, self.special_token_roles))
            source, state = f"preset {m.preset_name}", None
        if m.global_rope_theta is not None:  # context extension: the phase's own theta over its start's
            log.info("%s: global rotary theta %g (was %g)", m.phase, m.global_rope_theta, config.global_rope_theta)
            config = dataclasses.replace(config, global_rope_theta=float(m.global_rope_theta))
        return config, self._checked_model(config, state, source, vocab_size, seq_length)

    def export(self, model, config, vocab, directory, normalization, next_sentence_prediction: bool,
               dle_gelu: str) -> None:
        save_pretrained(model, config, vocab, directory)


class RobertaFamily(_Family):
    """RoBERTa and XLM-R (workflow/train/models/roberta.py): BERT's encoder with RoBERTa's positions and LM head,
    masked LM only, HF directories in and out (config.json's model_type, roberta or xlm-roberta, kept)."""

    name, display_name, model_types = "roberta", "RoBERTa", ("roberta", "xlm-roberta")
    module_name, config_name, pretraining_name = ("workflow.train.models.roberta", "RobertaConfig",
                                                  "RobertaForMaskedLM")
    special_token_roles = {"pad_token_id": "pad", "bos_token_id": "cls", "eos_token_id": "sep"}

    def positions(self, config) -> int:
        return config.positions  # the rows past the padding index

    @staticmethod
    def load_directory(directory):
        from workflow.train.models.roberta import load_pretrained as load_roberta

        return load_roberta(directory, key=None)

    @staticmethod
    def save_directory(model, config, vocab, directory, normalization) -> None:
        from workflow.train.models.roberta import save_pretrained as save_roberta

        save_roberta(model, config, vocab, directory)  # a tokenizer.json: no normalisation to write

    def build(self, m: ModelSettings, vocab: str | None, vocab_size: int, seq_length: int):
        """Model from an HF RoBERTa or XLM-R directory, or a preset sized to the vocab with its special ids (the
        position table sized past its padding id)."""
        from workflow.train.models import roberta

        if m.init_from:
            config, state = roberta.load_pretrained(m.init_from)
            check_same_vocab(m.init_from, config.vocab_size, vocab_size, vocab, padded_rows=True)
            source = m.init_from
        else:
            config = _preset(roberta.RobertaConfig, m, vocab_size=(vocab_size + 7) // 8 * 8,
                             **_special_ids(vocab, self.special_token_roles))
            source, state = f"preset {m.preset_name}", None
        return config, self._checked_model(config, state, source, vocab_size, seq_length)

    def export(self, model, config, vocab, directory, normalization, next_sentence_prediction: bool,
               dle_gelu: str) -> None:
        self.module.save_pretrained(model, config, vocab, directory)


def load_pretrained(directory: str | Path, key: str | None = "model.init_from"):
    """(ModernBertConfig, state dict) of an HF ModernBERT directory (HF's own save or ours; a bare ModernBertModel's
    weights under `model`: hf_weights); another model type is refused in one line (naming the config `key` that gave
    the directory, if any)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    where = f"{key} {directory}" if key else str(directory)
    if not config_path.is_file():
        raise UserError(f"{where}: not a Hugging Face model directory (no config.json)")
    from workflow.train.models import modernbert
    from workflow.train.models.hf_weights import read_weights
    from workflow.train.models.kit import read_config_json

    fields = read_config_json(config_path)
    if fields.get("model_type") != "modernbert":
        raise UserError(f"{where}: a {fields.get('model_type')!r} model, not a ModernBERT one "
                        "(model.family: modernbert); start a BERT with model.family: bert")
    state = read_weights(directory, where, modernbert.ModernBertForMaskedLM.base_model_prefix)
    state.pop("decoder.weight", None)  # tied to the token embeddings
    return modernbert.ModernBertConfig.from_dict(fields), state


def save_pretrained(model, config, vocab, directory) -> None:
    """An HF directory ModernBertForMaskedLM, AutoModelForMaskedLM and pipeline("fill-mask") load: model.safetensors
    (without the tied decoder.weight, as HF saves it), config.json (both transformers eras' keys), the tokenizer's
    files."""
    import torch
    from safetensors.torch import save_file

    from workflow.data.tokenizer import save_tokenizer

    model = getattr(model, "module", model)  # unwrap DDP
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in model.state_dict().items()
             if k != "decoder.weight"}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.to_json(directory / "config.json")
    if vocab is not None:
        save_tokenizer(vocab, directory, None, config.max_position_embeddings)


FAMILIES = {each.name: each for each in (BertFamily(), ModernBertFamily(), RobertaFamily())}


def _families_with(capability: str) -> str:
    return " or ".join(name for name, each in FAMILIES.items() if getattr(each, capability))


def family(name: str):
    if name not in FAMILIES:
        raise UserError(f"config model.family: {name!r} is not one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def directory_family(directory: str | Path):
    """The family of the model an HF directory holds, by its config.json's model_type (Family.model_types), else
    BERT's (whose loader reads BERT configs and judges the rest)."""
    from workflow.train.models.kit import read_config_json

    config_path = Path(directory) / "config.json"
    model_type = read_config_json(config_path).get("model_type") if config_path.is_file() else None
    return next((each for each in FAMILIES.values() if model_type in each.model_types), FAMILIES["bert"])
