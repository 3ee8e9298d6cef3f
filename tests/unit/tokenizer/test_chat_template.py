"""Where a chat template comes from and how it is chosen: ``chat_template.jinja`` over tokenizer_config.json, a list
of named templates, an override (``chat_template=``, ``--chat-template``), template variables
(``chat_template_kwargs``) - through the tokenizer, ``LLM.chat``, the CLI and the server."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from helpers import small_llm
from serve_helpers import ServerThread

from specdec import SamplingParams
from specdec.cli import main as cli_main
from specdec.tokenizer.tokenizer import Tokenizer

JINJA = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
         "{% if think is defined and think %}<think>{% endif %}{% if add_generation_prompt %}[assistant]{% endif %}")
HI = [{"role": "user", "content": "hi"}]


def folder_with(tiny_folder: str, dst: str, chat_template=None, jinja: str | None = None) -> str:
    """A copy of a tiny model folder whose tokenizer_config.json has ``chat_template`` (absent if None) and, if
    ``jinja``, a chat_template.jinja file."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(tiny_folder):
        shutil.copy(os.path.join(tiny_folder, name), dst)
    with open(os.path.join(dst, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg.pop("chat_template", None)
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    if jinja is not None:
        with open(os.path.join(dst, "chat_template.jinja"), "w") as f:
            f.write(jinja)
    return dst


def test_chat_template_jinja_is_read_and_wins(tiny_pair, tmp_path):
    only_file = folder_with(tiny_pair[0], str(tmp_path / "a"), jinja=JINJA)
    assert Tokenizer(only_file).apply_chat_template(HI) == "[user]hi[assistant]"
    both = folder_with(tiny_pair[0], str(tmp_path / "b"), chat_template="{{ 'config' }}", jinja=JINJA)
    assert Tokenizer(both).apply_chat_template(HI) == "[user]hi[assistant]"
    none = folder_with(tiny_pair[0], str(tmp_path / "c"))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(none).apply_chat_template(HI)


def test_named_templates_override_and_kwargs(tiny_pair, tmp_path):
    named = [{"name": "default", "template": JINJA}, {"name": "tool_use", "template": "{{ 'tools!' }}"}]
    tok = Tokenizer(folder_with(tiny_pair[0], str(tmp_path / "n"), chat_template=named))
    assert sorted(tok.chat_templates) == ["default", "tool_use"]
    assert tok.apply_chat_template(HI) == "[user]hi[assistant]"
    assert tok.apply_chat_template(HI, chat_template="tool_use") == "tools!"
    assert tok.apply_chat_template(HI, chat_template="<{{ messages[0]['content'] }}>") == "<hi>"
    assert tok.apply_chat_template(HI, chat_template_kwargs={"think": True}) == "[user]hi<think>[assistant]"
    with pytest.raises(ValueError, match="may not set"):
        tok.apply_chat_template(HI, chat_template_kwargs={"messages": []})


def test_llm_chat_cli_and_server_take_the_override(tiny_pair, tmp_path, capsys):
    folder = folder_with(tiny_pair[0], str(tmp_path / "m"), jinja=JINJA)
    llm = small_llm(folder, dtype="float32", block_size=4, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    default = llm.chat(HI, params)[0]
    assert llm.tokenizer.decode(default.prompt_token_ids) == "[user]hi[assistant]"
    thinking = llm.chat(HI, params, chat_template_kwargs={"think": True})[0]
    assert llm.tokenizer.decode(thinking.prompt_token_ids) == "[user]hi<think>[assistant]"
    other = llm.chat(HI, params, chat_template="Q: {{ messages[-1]['content'] }} A:")[0]
    assert llm.tokenizer.decode(other.prompt_token_ids) == "Q: hi A:"
    template_file = tmp_path / "t.jinja"
    template_file.write_text("Q: {{ messages[-1]['content'] }} A:")
    assert cli_main(["generate", "--model", folder, "--prompt", "hi", "--chat", "--chat-template",
                     str(template_file), "--max-tokens", "2", "--temperature", "0", "--dtype", "float32"]) == 0
    assert cli_main(["generate", "--model", folder, "--prompt", "hi", "--chat", "--chat-template", "no_such_name",
                     "--max-tokens", "2", "--dtype", "float32"]) == 2
    assert "neither a file" in capsys.readouterr().err
    server = ServerThread(folder, dtype="float32", block_size=4, max_model_len=128,
                          app_kwargs={"chat_template": "Q: {{ messages[-1]['content'] }} A:"}).start()
    try:
        got = server.client().chat.completions.create(model="tiny", messages=HI, max_tokens=4, temperature=0,
                                                      extra_body={"ignore_eos": True})
        assert got.choices[0].message.content == other.outputs[0].text
    finally:
        server.stop()
    plain = ServerThread(folder, dtype="float32", block_size=4, max_model_len=128).start()
    try:
        got = plain.client().chat.completions.create(model="tiny", messages=HI, max_tokens=4, temperature=0,
                                                     extra_body={"ignore_eos": True,
                                                                 "chat_template_kwargs": {"think": True}})
        assert got.choices[0].message.content == thinking.outputs[0].text
    finally:
        plain.stop()
