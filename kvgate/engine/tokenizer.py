"""A served model's tokenizer and chat template, applied the way vLLM applies them.

vLLM renders a chat with transformers' `apply_chat_template` (a sandboxed Jinja environment with
trim_blocks, lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now` and a
`tojson` that keeps non-ASCII text), passing the tokenizer's special tokens, `tools`,
`add_generation_prompt` and the request's `chat_template_kwargs`, then tokenizes the text without
special tokens. A completions prompt is tokenized with special tokens (the tokenizer's own BOS
handling). Both are reproduced here from the files vLLM loads: `tokenizer.json` (the HF `tokenizers`
library) and `tokenizer_config.json` (special tokens and the chat template).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import orjson
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from xxhash import xxh3_64_intdigest

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# vLLM's "auto" content format: a template that loops over a message's content gets OpenAI-style parts.
_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content(?!\w))")


_SEGMENT_CACHE_CHARS = 8 * 1024 * 1024  # text kept with its token ids: system prompts and earlier turns repeat
_LENGTHS_KEPT = 4096  # leading parts (a tenant's instructions) whose token count is remembered


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be loaded, or a request its template refuses."""


class EngineTokenizer:
    """Turns a chat or completions request into the token ids vLLM computes for it."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, special_tokens: Mapping[str, str]) -> None:
        self._tokenizer = tokenizer
        self._segments = _SegmentEncoder.for_tokenizer(tokenizer)
        self._special_tokens = dict(special_tokens)
        self._template = _compile(chat_template) if chat_template else None
        self._openai_content = bool(chat_template and _LOOPS_OVER_CONTENT.search(chat_template))
        self._lengths: OrderedDict[int, int] = OrderedDict()  # leading_messages_length, per leading part's hash
        self._lengths_lock = threading.Lock()  # long prompts are tokenized on worker threads

    @classmethod
    def load(cls, directory: str | Path) -> EngineTokenizer:
        """Load `tokenizer.json` and `tokenizer_config.json` from a model directory."""
        directory = Path(directory)
        try:
            tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as exc:  # the tokenizers library raises a bare Exception for unreadable files
            raise TokenizerError(f"{directory}: cannot load tokenizer.json: {exc}") from None
        config = _read_json(directory / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # a list of named templates: vLLM takes the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_file = directory / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        special = {name: _token_text(config[name]) for name in _SPECIAL_TOKENS if config.get(name) is not None}
        return cls(tokenizer, template if isinstance(template, str) else None, special)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`, exactly as the `tokenizers` library encodes the whole text."""
        if self._segments is not None:
            return self._segments.encode(text, add_special_tokens)
        return self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def render_chat(self, body: Mapping[str, Any]) -> str:
        """The prompt text vLLM renders for a chat request body."""
        if self._template is None:
            raise TokenizerError("the model has no chat template")
        kwargs = body.get("chat_template_kwargs")
        kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
        add_generation_prompt = body.get("add_generation_prompt", True)
        continue_final = body.get("continue_final_message", False) is True
        context = {**self._special_tokens, **kwargs,
                   "messages": [self._message(message) for message in body.get("messages", ())],
                   "tools": _tools(body.get("tools")), "documents": body.get("documents"),
                   "add_generation_prompt": add_generation_prompt is not False and not continue_final}
        try:
            text = self._template.render(**context)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template: {exc}") from None
        if continue_final:
            text = _strip_after_final_message(text, context["messages"])
        return text

    def chat_ids(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of a chat request, as vLLM tokenizes the rendered template (no special tokens by default)."""
        add_special = body.get("add_special_tokens", False) is True
        return self.encode(self.render_chat(body), add_special_tokens=add_special)

    def leading_messages_length(self, body: Mapping[str, Any], messages: int, ids: Sequence[int]) -> int:
        """How many of a chat's token `ids` its tools and first `messages` messages account for: the ids those render
        to alone (no generation prompt) that `ids` start with; 0 when the template cannot render them alone.

        A tenant's conversations share these (its instructions), so the count is remembered per distinct leading
        part: a template renders it the same whatever follows.
        """
        leading = {**body, "messages": list(body.get("messages", ()))[:messages], "add_generation_prompt": False,
                   "continue_final_message": False}
        key = xxh3_64_intdigest(orjson.dumps([leading["messages"], body.get("tools"), body.get("chat_template_kwargs"),
                                              body.get("add_special_tokens")], default=str))
        with self._lengths_lock:
            known = self._lengths.get(key)
            if known is not None:
                self._lengths.move_to_end(key)
                return known
        try:
            alone = self.chat_ids(leading)
        except TokenizerError:
            alone = []
        length = _common_prefix(alone, ids)
        with self._lengths_lock:
            self._lengths[key] = length
            if len(self._lengths) > _LENGTHS_KEPT:
                self._lengths.popitem(last=False)
        return length

    def completion_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        """Token ids of a completions request's first prompt (string or token ids); None when it has none."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch goes to one replica: its first prompt places it
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=body.get("add_special_tokens", True) is not False)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        return None

    def request_ids(self, kind: str, body: Mapping[str, Any]) -> list[int] | None:
        """Token ids of a chat or completions body; None for other kinds."""
        if kind == "chat":
            return self.chat_ids(body)
        if kind == "completion":
            return self.completion_ids(body)
        return None

    def _message(self, message: Any) -> dict[str, Any]:
        """A message as vLLM hands it to the template: text parts joined, tool-call arguments parsed."""
        if not isinstance(message, dict):
            raise TokenizerError("a message is not an object")
        content = message.get("content")
        if self._openai_content:
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else \
                [{"type": "text", "text": part["text"]} for part in content or () if _is_text(part)]
            result: dict[str, Any] = {"role": message.get("role"), "content": parts}
        else:
            text = content if isinstance(content, str) else \
                "\n".join(part["text"] for part in content or () if _is_text(part))
            result = {"role": message.get("role"), "content": text}
        if message.get("role") == "assistant" and message.get("tool_calls") is not None:
            result["tool_calls"] = [_parsed_tool_call(call) for call in message["tool_calls"]]
        if message.get("role") == "tool" and "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            result["name"] = message["name"]
        return result


class _SegmentEncoder:
    """Encodes the pieces between added tokens separately, remembering recent ones.

    The `tokenizers` library itself splits text on its added tokens (special ones included) and encodes
    each piece on its own, so the ids of a chat are its pieces' ids with the added tokens' ids between
    them: a system prompt or an earlier turn that comes again is not tokenized again. Used only when no
    added token strips neighbouring spaces or matches normalized text, where that equality holds as is.
    """

    def __init__(self, tokenizer: Tokenizer, added: Mapping[str, int]) -> None:
        self._tokenizer = tokenizer
        self._added = dict(added)
        names = sorted(added, key=len, reverse=True)  # longest first: the library matches leftmost-longest
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")")
        with_specials = tokenizer.encode("a", add_special_tokens=True).ids
        bare = tokenizer.encode("a", add_special_tokens=False).ids
        at = with_specials.index(bare[0]) if bare and bare[0] in with_specials else 0
        self._prefix, self._suffix = with_specials[:at], with_specials[at + len(bare):]
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()  # long prompts are encoded on worker threads

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> _SegmentEncoder | None:
        """The encoder, or None when some added token's flags make pieces depend on their neighbours."""
        added = tokenizer.get_added_tokens_decoder()
        if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added.values()):
            return None
        return cls(tokenizer, {token.content: token_id for token_id, token in added.items()})

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        pieces = self._split.split(text)
        with self._lock:
            known = {piece: self._recall(piece) for piece in pieces if piece and piece not in self._added}
        missing = [piece for piece, ids in known.items() if ids is None]
        if missing:
            encoded = self._tokenizer.encode_batch_fast(missing, add_special_tokens=False)
            fresh = dict(zip(missing, (encoding.ids for encoding in encoded)))
            known.update(fresh)
            self._remember(fresh)
        ids = list(self._prefix) if add_special_tokens else []
        for piece in pieces:
            if piece in self._added:
                ids.append(self._added[piece])
            elif piece:
                ids.extend(known[piece])  # type: ignore[arg-type]
        return ids + self._suffix if add_special_tokens else ids

    def _recall(self, piece: str) -> list[int] | None:
        """A remembered piece's ids, now the most recently used; call with the lock held."""
        ids = self._cache.get(piece)
        if ids is not None:
            self._cache.move_to_end(piece)
        return ids

    def _remember(self, fresh: Mapping[str, list[int]]) -> None:
        """Keep newly encoded pieces, dropping the least recently used beyond the cache's size."""
        with self._lock:
            for piece, ids in fresh.items():
                if piece not in self._cache:
                    self._cache[piece] = ids
                    self._cached_chars += len(piece)
            while self._cached_chars > _SEGMENT_CACHE_CHARS:
                piece, _ = self._cache.popitem(last=False)
                self._cached_chars -= len(piece)


def _common_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    """How many leading ids the two sequences share."""
    if len(first) <= len(second) and list(second[:len(first)]) == list(first):
        return len(first)
    return next((at for at, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))


def _compile(template: str) -> jinja2.Template:
    """The template compiled in transformers' environment."""
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return environment.from_string(template)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"chat template does not compile: {exc}") from None


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """Tools as vLLM's request model dumps them: every function field present, None when unset."""
    if not isinstance(tools, list) or not tools:
        return None
    dumped = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            raise TokenizerError("a tool has no function")
        dumped.append({"type": tool.get("type", "function"),
                       "function": {"name": function.get("name"), "description": function.get("description"),
                                    "parameters": function.get("parameters")}})
    return dumped


def _parsed_tool_call(call: Any) -> Any:
    """A tool call whose JSON `arguments` string vLLM parses into an object before rendering."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return {**call, "function": {**call["function"], "arguments": arguments}}


def _strip_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """`continue_final_message`: the prompt ends where the final message's content ends."""
    final = messages[-1]["content"] if messages else ""
    if isinstance(final, list):
        final = final[-1]["text"] if final else ""
    end = text.rfind(final.strip()) if final.strip() else -1
    return text if end < 0 else text[: end + len(final.strip())]


def _is_text(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str)


def _token_text(value: Any) -> str:
    """A special token given as a string or as an AddedToken mapping."""
    return value.get("content", "") if isinstance(value, dict) else str(value)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: cannot read: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: must hold a JSON object")
    return data
