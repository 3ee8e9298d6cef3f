"""Training data for an EAGLE-3 head: the target's own answers to prompts (EAGLE's "regenerate" recipe).

Prompts come from a JSON-lines file (``{"prompt": "..."}`` per line; the shipped ``prompts.jsonl`` by default) or
are written by the target itself (``self_prompts``): it continues its chat template's user turn from the empty
content, sampled, and stops at its end of turn. Each prompt is rendered with the chat template, and the target
answers it (greedy or sampled) with ``specdec.LLM``, in batches. Samples are appended to ``OUT/data/samples.jsonl``
as token ids after every batch, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

SHIPPED_PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"
_SENTINEL = "\x00SPECDEC_PROMPT\x00"  # stands in for the user's text when cutting the chat template


@dataclass(frozen=True)
class Sample:
    """One training sequence: the rendered prompt's ids and the target's answer ids (int lists)."""

    prompt_ids: list[int]
    answer_ids: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.answer_ids


def read_prompts(path: str | os.PathLike) -> list[str]:
    """The prompts of a JSON-lines file (``{"prompt": str}`` per line) or a plain text file (one per line);
    ``ValueError`` if it is missing or has none."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if path.suffix == ".jsonl":
                try:
                    prompt = json.loads(line)["prompt"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: expected a JSON object with a 'prompt' string ({e})") from e
                if not isinstance(prompt, str):
                    raise ValueError(f"{path}:{n}: 'prompt' must be a string")
                line = prompt
            prompts.append(line)
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


def chat_ids(llm, prompt: str) -> list[int]:
    """``prompt`` as one user turn of the target's chat template (plain text when it has none), as token ids."""
    tok = llm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if tok.chat_template else prompt
    return tok.encode(text)


def user_turn_prefix(llm) -> str:
    """The chat template rendered up to where the user's text begins (system prompt and user header)."""
    tok = llm.tokenizer
    if not tok.chat_template:
        raise ValueError("--self-prompts needs a target with a chat template (tokenizer_config.json 'chat_template')")
    text = tok.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
    return text[: text.index(_SENTINEL)]


def self_prompts(llm, n: int, max_tokens: int = 64, temperature: float = 1.0, seed: int = 0,
                 batch_size: int = 32) -> list[str]:
    """``n`` prompts the target writes from its chat template's empty user turn (sampled, ``seed`` fixed);
    empty ones are dropped and replaced."""
    from specdec import SamplingParams

    prefix = llm.tokenizer.encode(user_turn_prefix(llm))
    prompts: list[str] = []
    attempt = 0
    with tqdm(total=n, desc="self-prompts", unit="prompt") as bar:
        while len(prompts) < n and attempt < 4 * n:
            k = min(batch_size, n - len(prompts))
            params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + attempt + i)
                      for i in range(k)]
            attempt += k
            for out in llm.generate(prompt_token_ids=[prefix] * k, sampling_params=params):
                text = out.outputs[0].text.strip()
                if text:
                    prompts.append(text)
                    bar.update(1)
    return prompts


def generate_samples(llm, prompts: list[str], data_dir: str | os.PathLike, max_new_tokens: int,
                     temperature: float = 0.0, batch_size: int = 16, seed: int = 0) -> list[Sample]:
    """The target's answers to ``prompts``, appended to ``data_dir/samples.jsonl`` one batch at a time; samples
    already there (an earlier, interrupted run with the same prompts) are kept and not generated again."""
    from specdec import SamplingParams

    file = Path(data_dir) / "samples.jsonl"
    file.parent.mkdir(parents=True, exist_ok=True)
    samples = load_samples(file) if file.is_file() else []
    _rewrite(file, samples)  # drops a torn last line before appending
    if len(samples) > len(prompts):
        raise ValueError(f"{file} holds {len(samples)} samples but only {len(prompts)} prompts were given: "
                         "use another output folder, or the prompts it was made from")
    start = time.perf_counter()
    new_tokens = 0
    with open(file, "a", encoding="utf-8") as f, tqdm(total=len(prompts), initial=len(samples),
                                                        desc="target answers", unit="prompt") as bar:
        for lo in range(len(samples), len(prompts), batch_size):
            batch = [chat_ids(llm, p) for p in prompts[lo : lo + batch_size]]
            params = [SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed + lo + i)
                      for i in range(len(batch))]
            for ids, out in zip(batch, llm.generate(prompt_token_ids=batch, sampling_params=params), strict=True):
                sample = Sample(ids, list(out.outputs[0].token_ids))
                samples.append(sample)
                new_tokens += len(sample.answer_ids)
                f.write(_line(sample))
            f.flush()
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / max(time.perf_counter() - start, 1e-9):.1f}")
    return samples


def load_samples(file: str | os.PathLike) -> list[Sample]:
    """The samples of a ``samples.jsonl`` (a torn last line, from an interrupted write, is dropped)."""
    samples = []
    with open(file, encoding="utf-8") as f:
        for line in f:
            try:
                raw = json.loads(line)
            except json.JSONDecodeError:
                break
            samples.append(Sample(raw["prompt_ids"], raw["answer_ids"]))
    return samples


def _line(sample: Sample) -> str:
    return json.dumps({"prompt_ids": sample.prompt_ids, "answer_ids": sample.answer_ids}) + "\n"


def _rewrite(file: Path, samples: list[Sample]) -> None:
    with open(file, "w", encoding="utf-8") as f:
        f.writelines(_line(s) for s in samples)
