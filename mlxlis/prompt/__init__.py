"""From messages to the prompt text, never guessed: chat templates found where the model keeps
them and rendered in jinja2's sandbox (template.py, sandbox.py), the "no template" diagnosis
naming its likely cause (diagnosis.py), the built-in templates used only when named
(templates/), and the split of a reasoning model's reply into reasoning and answer
(reasoning.py). Imports the tokenizer layer and below."""
