"""OpenAI's `POST /v1/audio/transcriptions` and `POST /v1/audio/translations` for a model
that hears (Gemma 3n, Voxtral).

The multipart form (`file`, `model`, `prompt`, `language`, `response_format`, `temperature`)
becomes one chat request through the same builder as /v1/chat/completions: the file's
samples (mono, at the model's rate) cut into its 30 s windows, each a user turn of an
input_audio part and the instruction — Google's documented transcription prompt for Gemma
("Transcribe the following speech segment in {language} into {language} text." and its
formatting rules), or the request's `prompt` in its place — each window's reply a segment,
joined with spaces. A translation (into English, as OpenAI's endpoint) asks Google's
documented speech-translation prompt ("Transcribe the following speech segment in …, then
translate it into English." and its format: the transcription, a newline, "English: " and
the translation); the text after "English: " is the translation (the whole reply where the
model did not write it). A model whose hearing does not list the task (`Hearing.tasks`) is
refused naming it. A model with a transcription request of its own (multimodal.Transcribes:
Voxtral's mistral_common request, "lang:xx" where `language` is given) is asked it instead of a
chat, window by window; a `prompt` it cannot take is refused. `response_format`: json
({"text"}), text, verbose_json (duration, language, segments with their times), srt or vtt (a
cue per segment).
"""

from __future__ import annotations

import base64
import io
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

from mlxlis.errors import MlxlisError
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.sequence import Request as GenRequest
from mlxlis.models.multimodal import Transcribes
from mlxlis.prompt.audio import load_audio, windows
from mlxlis.serve.openai_format import APIError, new_id
from mlxlis.serve.prepare import Prepared, Target, fit, prepare_chat
from mlxlis.serve.reply import CompletionReply
from mlxlis.serve.schemas import ChatCompletionRequest
from mlxlis.serve.service import Service, collect

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
WINDOW_SECONDS = 30  # Gemma 3n's processor reads 30 s of audio
WINDOW_TOKENS = 256  # a window's reply at most (30 s of speech is some 100 words)
INSTRUCTION = (
    "Transcribe the following speech segment in {language} into {language} text.\n\n"
    "Follow these specific instructions for formatting the answer:\n"
    "* Only output the transcription, with no newlines.\n"
    "* When transcribing numbers, write the digits, i.e. write 1.7 and not one point seven, "
    "and write 3 instead of three."
)
TRANSLATION = (
    "Transcribe the following speech segment in {language}, then translate it into English.\n"
    "When formatting the answer, first output the transcription in {language}, then one "
    "newline, then output the string 'English: ', then the translation in English."
)
TRANSLATED = "English: "  # what comes before the translation in the reply
LANGUAGES = {  # ISO-639-1 codes OpenAI's `language` takes -> the names the prompt says
    "en": "English", "de": "German", "fr": "French", "es": "Spanish", "it": "Italian",
    "pt": "Portuguese", "nl": "Dutch", "ru": "Russian", "ja": "Japanese", "ko": "Korean",
    "zh": "Chinese", "ar": "Arabic", "hi": "Hindi", "pl": "Polish", "tr": "Turkish",
    "sv": "Swedish", "uk": "Ukrainian", "id": "Indonesian", "vi": "Vietnamese",
}  # fmt: skip


def bad(message: str, param: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def form_fields(body: bytes, content_type: str) -> dict[str, tuple[bytes, str | None]]:
    """A multipart/form-data body -> {name: (bytes, file name or None)}."""
    if not content_type.startswith("multipart/form-data"):
        raise APIError(400, "expected a multipart/form-data body", param="file")
    head = f"Content-Type: {content_type}\r\n\r\n".encode()
    message = BytesParser(policy=HTTP).parsebytes(head + body)
    out: dict[str, tuple[bytes, str | None]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            out[name] = (part.get_payload(decode=True) or b"", part.get_filename())
    return out


def instruction(language: str | None, prompt: str | None) -> str:
    if prompt:
        return prompt
    if language is None:
        return INSTRUCTION.format(language="its spoken language").replace(
            "into its spoken language text", "into text"
        )
    if language not in LANGUAGES:
        raise bad(f"{language!r} is not a language code mlxlis names", "language")
    return INSTRUCTION.format(language=LANGUAGES[language])


def translation(reply: str) -> str:
    """The translation in a reply to TRANSLATION: the text after its last "English: "."""
    _, found, after = reply.rpartition(TRANSLATED)
    return after.strip() if found else reply.strip()


def window_bytes(samples: np.ndarray, rate: int) -> bytes:
    """One window as a float WAV file (its samples exactly)."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def window_wav(samples: np.ndarray, rate: int) -> str:
    """One window as base64 float WAV."""
    return base64.b64encode(window_bytes(samples, rate)).decode()


def prepare_request(
    t: Target, hearing: Transcribes, wav: bytes, language: str | None, temperature: float
) -> Prepared:
    """The model's own transcription request for one window (on the preparing thread)."""
    clip = hearing.prepare_audio(wav, "file", "audio")
    ids = hearing.transcription(clip, language)
    params = SamplingParams(temperature=temperature, max_tokens=WINDOW_TOKENS)
    params, _ = fit(t, ids, params, False, "file")
    spans = t.model.image_spans(ids, (clip,))
    return Prepared(GenRequest(ids, params, stop_ids=t.stop_ids, images=spans), None, None)


async def own_request(svc: Service, served: Any, wav: bytes, text: dict, request: Any) -> str:
    """One window transcribed by the model's own request (Transcribes)."""
    language = text.get("language")
    if text.get("prompt"):
        raise bad(f"{served.name}'s transcription request takes no prompt", "prompt")
    if language is not None and not (len(language) == 2 and language.isalpha()):
        raise bad(f"{language!r} is not an ISO-639-1 code", "language")
    try:
        temperature = float(text.get("temperature", "0"))
    except ValueError:
        raise bad("expected a number", "temperature") from None
    hearing = served.model.hearing
    with served.held():
        prep = await svc.prepare(
            served, prepare_request, hearing, wav, language and language.lower(), temperature
        )
        run = svc.submit(served, prep, new_id("transcribe"), request)
    reply = CompletionReply(served.token_text, logprobs=False)
    await collect(run, reply.feed)
    return reply.text.strip()


def stamp(t: float, sep: str) -> str:
    ms = int(round(t * 1000))
    return (
        f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"
    )


def rendered(
    segments: list[tuple[float, float, str]], fmt: str, language: str | None, task: str
) -> Any:
    text = " ".join(s for _, _, s in segments)
    if fmt == "json":
        return {"text": text}
    if fmt == "text":
        return PlainTextResponse(text)
    if fmt == "verbose_json":
        return {
            "task": task,
            "language": LANGUAGES.get(language or "", language or "").lower() or None,
            "duration": segments[-1][1] if segments else 0.0,
            "text": text,
            "segments": [
                {"id": i, "seek": 0, "start": a, "end": b, "text": s, "tokens": []}
                for i, (a, b, s) in enumerate(segments)
            ],
        }
    sep = "," if fmt == "srt" else "."
    cues = [
        (f"{i + 1}\n" if fmt == "srt" else "") + f"{stamp(a, sep)} --> {stamp(b, sep)}\n{s}\n"
        for i, (a, b, s) in enumerate(segments)
    ]
    head = "" if fmt == "srt" else "WEBVTT\n\n"
    return PlainTextResponse(head + "\n".join(cues))


def router(svc: Service, auth: list) -> APIRouter:
    r = APIRouter()

    async def heard(request: Request, task: str) -> Any:
        """The request's audio transcribed or translated (`task`), window by window."""
        body = await request.body()
        if len(body) > svc.state.max_body:
            raise APIError(413, f"the request body is over {svc.state.max_body} bytes")
        form = form_fields(body, request.headers.get("content-type", ""))
        text = {k: v.decode("utf-8", "replace") for k, (v, f) in form.items() if f is None}
        if "file" not in form:
            raise bad(f"a {task} request needs the audio file", "file")
        fmt = text.get("response_format", "json")
        if fmt not in FORMATS:
            raise bad(f"expected one of {', '.join(FORMATS)}", "response_format")
        try:
            temperature = float(text.get("temperature", "0"))
        except ValueError:
            raise bad("expected a number", "temperature") from None
        served = await svc.model(text.get("model"), None)
        hearing = served.model.hearing
        if hearing is None:
            raise bad(f"{served.name} takes no audio", "model")
        if task not in hearing.tasks:
            raise bad(
                f"{served.name} cannot {task} audio (it does {', '.join(hearing.tasks)})", "model"
            )
        try:
            samples = load_audio(form["file"][0], hearing.rate, "file")
        except MlxlisError as e:
            raise bad(e.message, "file") from None
        if task == "translate":
            ask = text.get("prompt") or TRANSLATION.format(language="its spoken language")
        elif not isinstance(hearing, Transcribes):
            ask = instruction(text.get("language"), text.get("prompt"))
        size, segments = WINDOW_SECONDS * hearing.rate, []
        for k, window in enumerate(windows(samples, size)):
            start = k * WINDOW_SECONDS
            end = start + len(window) / hearing.rate
            if task == "transcribe" and isinstance(hearing, Transcribes):
                wav = window_bytes(window, hearing.rate)
                segments.append(
                    (float(start), end, await own_request(svc, served, wav, text, request))
                )
                continue
            audio = {"data": window_wav(window, hearing.rate), "format": "wav"}
            content = [{"type": "input_audio", "input_audio": audio}, {"type": "text", "text": ask}]
            req = ChatCompletionRequest(
                model=served.name,
                messages=[{"role": "user", "content": content}],
                temperature=temperature,
                max_tokens=WINDOW_TOKENS,
            )
            with served.held():
                prep = await svc.prepare(served, prepare_chat, req)
                reply = svc.chat_reply(served, prep, False)
                run = svc.submit(served, prep, new_id("transcribe"), request)
            await collect(run, reply.feed)
            said = (reply.message().get("content") or "").strip()
            if task == "translate":
                said = translation(said)
            segments.append((float(start), end, said))
        return rendered(segments, fmt, text.get("language"), task)

    @r.post("/v1/audio/transcriptions", dependencies=auth)
    async def transcriptions(request: Request) -> Any:
        return await heard(request, "transcribe")

    @r.post("/v1/audio/translations", dependencies=auth)
    async def translations(request: Request) -> Any:
        return await heard(request, "translate")

    return r
