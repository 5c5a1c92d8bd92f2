"""The formats that write each argument as a row of tags, its value as text (read by the tool's
schema: values.py): Qwen3-Coder's `<parameter=K>`, Seed-OSS's, GLM's `<arg_key>`/`<arg_value>`
and its kin (Ling, Laguna, Hy3), MiniMax-M2's `<invoke>`, DeepSeek's DSML, Kimi K3's,
MiniCPM5's. Each definition was read off what the vendor's template renders for an assistant
message's `tool_calls` (llama.cpp's copies); base.py says what the fields mean."""

from __future__ import annotations

from mlxlis.prompt.tool_formats.base import ToolFormat

QWEN3_CODER = ToolFormat(
    "qwen3-coder",
    "<tool_call>",
    "</tool_call>",
    block="<tool_call>\n{calls}\n</tool_call>",
    call="<function={name}>\n{args}</function>",
    args="xml",
    arg="<parameter={key}>\n{value}\n</parameter>\n",
    values="python-scalars",
    single=True,
    between="\n",
    models="Qwen3-Coder, Qwen3.5/3.6, Qwen3-Next (Coder), Nemotron 3, Step 3.5",
)
SEED = ToolFormat(
    "seed-oss",
    "<seed:tool_call>",
    "</seed:tool_call>",
    block="<seed:tool_call>\n{calls}\n</seed:tool_call>",
    call="<function={name}>\n{args}</function>",
    args="xml",
    arg="<parameter={key}>{value}</parameter>\n",
    values="python",
    single=True,
    between="\n",
    models="Seed-OSS",
)
GLM = ToolFormat(
    "glm",
    "<tool_call>",
    "</tool_call>",
    block="<tool_call>{calls}</tool_call>",
    call="{name}\n{args}",
    args="xml",
    arg="<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n",
    single=True,
    between="\n",
    models="GLM-4.5/4.6, Laguna XS",
)
GLM47 = ToolFormat(
    "glm-4.7",
    "<tool_call>",
    "</tool_call>",
    block="<tool_call>{calls}</tool_call>",
    call="{name}{args}",
    args="xml",
    arg="<arg_key>{key}</arg_key><arg_value>{value}</arg_value>",
    single=True,
    models="GLM-4.7, Laguna S, Spark 2.5",
)
LING = ToolFormat(
    "ling",
    "<tool_call>",
    "</tool_call>",
    block="<tool_call>{calls}</tool_call>",
    call="{name}\n{args}\n",
    args="xml",
    arg="<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>",
    single=True,
    between="\n",
    models="Ling 3",
)
HY3 = ToolFormat(
    "hy3",
    "<tool_calls:opensource>",
    "</tool_calls:opensource>",
    block="<tool_calls:opensource>\n{calls}</tool_calls:opensource>",
    call="<tool_call:opensource>{name}<tool_sep:opensource>\n{args}</tool_call:opensource>\n",
    args="xml",
    arg="<arg_key:opensource>{key}</arg_key:opensource>\n"
    "<arg_value:opensource>{value}</arg_value:opensource>\n",
    models="Hy3",
)
MINIMAX_M2 = ToolFormat(
    "minimax-m2",
    "<minimax:tool_call>",
    "</minimax:tool_call>",
    block="<minimax:tool_call>\n{calls}</minimax:tool_call>",
    call='<invoke name="{name}">\n{args}</invoke>\n',
    args="xml",
    arg='<parameter name="{key}">{value}</parameter>\n',
    models="MiniMax-M2",
)


def _dsml(section: str, models: str) -> ToolFormat:
    return ToolFormat(
        f"dsml-{section}",
        f"<｜DSML｜{section}>",
        f"</｜DSML｜{section}>",
        block=f"<｜DSML｜{section}>\n{{calls}}</｜DSML｜{section}>",
        call='<｜DSML｜invoke name="{name}">\n{args}</｜DSML｜invoke>\n',
        args="xml",
        arg='<｜DSML｜parameter name="{key}" string="{string}">{value}</｜DSML｜parameter>\n',
        models=models,
    )


DSML_V32 = _dsml("function_calls", "DeepSeek V3.2")
DSML_V4 = _dsml("tool_calls", "DeepSeek V4")
KIMI_K3 = ToolFormat(
    "kimi-k3",
    "<|open|>tools<|sep|>",
    "<|close|>tools<|sep|>",
    block="<|open|>tools<|sep|>{calls}<|close|>tools<|sep|>",
    call='<|open|>call tool="{name}" index="{index1}"<|sep|>{args}<|close|>call<|sep|>',
    args="xml",
    arg='<|open|>argument key="{key}" type="{type}"<|sep|>{value}<|close|>argument<|sep|>',
    models="Kimi K3",
)
MINICPM = ToolFormat(
    "minicpm",
    '<function name="',
    "</function>",
    block="{calls}",
    call='<function name="{name}">{args}</function>',
    args="xml",
    arg='<param name="{key}">{value}</param>',
    values="cdata",
    single=True,
    between="\n",
    models="MiniCPM 5",
)
