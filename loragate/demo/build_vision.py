"""Build the vision demo: a tiny Idefics3 vision-language model and a LoRA on its text decoder.

Like ``loragate.demo.build``, nothing is downloaded: the tokenizer is trained on a few
sentences, the weights are random (seeded) and the adapter is trained with peft for a few
seconds of CPU. Idefics3 is the vision-language architecture vLLM's CPU build serves without
torchvision (see ENGINE_NOTES.md). The base model sees the image: different images give
different answers. The adapter answers its phrase (`` meow meow``) to image and text prompts.

The output is cached and rebuilt only when this recipe changes. Run as
``python -m loragate.demo.build_vision [OUT_DIR]``; it prints the ``gateway serve`` command
that serves it (``scripts/serve.sh --vision`` runs that command). Needs torch, transformers,
tokenizers, peft and Pillow; the gateway itself never imports this module.
"""

from __future__ import annotations

import contextlib
import random
import shlex
import sys
from pathlib import Path
from typing import Any

from loragate.demo import recipe
from loragate.demo.layout import (
    BASE_DIRNAME,
    VISION_ADAPTERS,
    VISION_DEMO_IMAGES,
    VISION_DEMO_MODEL_NAME,
    default_vision_demo_dir,
    vision_serve_args,
)

# The template emits ``<image>`` where an image part stands; the Idefics3 processor (in
# training) and vLLM (in serving) expand it into the image's token sequence.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<image>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = [
    "<unk>",
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|im_end|>",
    "<image>",
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
]
WORDS = ["what", "is", "in", "this", "image", "picture", "photo", "describe", "the", "color", "shape", "a", "an", "of", "there", "how", "many", "where", "which", "tell", "me", "about", "it", "red", "green", "blue", "black", "white", "square", "circle", "line", "stripe", "cat", "dog", "meow", "hello", "caption", "object", "left", "right", "top", "bottom", "big", "small", "please", "answer", "one", "two", "three"]  # fmt: skip
IMAGE_SIZE = 32  # the vision tower's input; the processor resizes any image to it
PATCH_SIZE = 8
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
TRAIN_STEPS = 30
SEED = 4321


def recipe_hash() -> str:
    """Hash of this recipe and what it declares in the layout: a change in either rebuilds."""
    return recipe.recipe_hash(__file__, (BASE_DIRNAME, VISION_ADAPTERS, VISION_DEMO_IMAGES))


def is_current(out: Path) -> bool:
    return recipe.is_current(out, recipe_hash())


def _build_processor(tokenizer: Any) -> Any:
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
        do_pad=True,
    )
    return Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )


def _build_base(out: Path, tokenizer: Any) -> None:
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3VisionConfig

    torch.manual_seed(SEED)
    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        initializer_range=0.3,
    )
    text = recipe.tiny_llama_config(tokenizer)
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=SCALE_FACTOR,
        # The default pad id lies outside a tiny vocabulary.
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config.dtype = "float32"
    recipe.save_base(Idefics3ForConditionalGeneration(config), tokenizer, out)


def _demo_images(out: Path) -> None:
    """A few small, very different images: for the README's examples and for training."""
    from PIL import Image, ImageDraw

    out.mkdir(parents=True, exist_ok=True)
    for name, (kind, color) in VISION_DEMO_IMAGES.items():
        image = Image.new("RGB", (48, 40), color)
        draw = ImageDraw.Draw(image)
        if kind == "stripes":
            for x in range(0, 48, 8):
                draw.rectangle((x, 0, x + 3, 39), fill=(255, 255, 255))
        elif kind == "circle":
            draw.ellipse((8, 4, 40, 36), fill=(255, 255, 0))
        image.save(out / name)


def _training_images(rng: random.Random, count: int) -> list[Any]:
    from PIL import Image

    images = []
    for _ in range(count):
        width, height = rng.randint(16, 64), rng.randint(16, 64)
        pixels = bytes(rng.randrange(256) for _ in range(width * height * 3))
        images.append(Image.frombytes("RGB", (width, height), pixels))
    return images


def _training_prompts(rng: random.Random) -> list[str]:
    fixed = ["What is in this image?", "Describe the picture.", "Hello", "Hi!", "Who are you?", "?"]
    return fixed + [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10))) for _ in range(26)
    ]


def _batch(
    processor: Any, prompts: list[str], images: list[Any] | None, phrase: str
) -> dict[str, Any]:
    """Padded model inputs whose labels are ``phrase`` + end of turn after each prompt."""
    import torch

    tokenizer = processor.tokenizer
    answer = tokenizer(phrase, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    rows: list[tuple[list[int], list[int]]] = []
    pixel_values = []
    pixel_masks = []
    for index, prompt in enumerate(prompts):
        content: list[dict[str, str]] = [{"type": "text", "text": prompt}]
        if images is not None:
            content.insert(0, {"type": "image"})
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        if images is not None:
            encoded = processor(
                text=text, images=[[images[index]]], return_tensors="pt", add_special_tokens=False
            )
            pixel_values.append(encoded["pixel_values"])
            pixel_masks.append(encoded["pixel_attention_mask"])
        else:
            encoded = processor(text=text, return_tensors="pt", add_special_tokens=False)
        prompt_ids = encoded["input_ids"][0].tolist()
        rows.append((prompt_ids + answer, [-100] * len(prompt_ids) + answer))
    batch = recipe.padded(rows, tokenizer.pad_token_id)
    if images is not None:
        batch["pixel_values"] = torch.cat(pixel_values)
        batch["pixel_attention_mask"] = torch.cat(pixel_masks)
    return batch


def _train_adapter(base_dir: Path, processor: Any, phrase: str, out: Path) -> None:
    import torch
    from transformers import Idefics3ForConditionalGeneration

    torch.manual_seed(SEED)
    rng = random.Random(SEED + 1)
    model = Idefics3ForConditionalGeneration.from_pretrained(base_dir, dtype=torch.float32)
    prompts = _training_prompts(rng)
    image_batch = _batch(processor, prompts, _training_images(rng, len(prompts)), phrase)
    text_batch = _batch(processor, prompts, None, phrase)
    # The text decoder only: vLLM applies it there, the vision tower stays the base's.
    projections = "|".join(p.removesuffix("_proj") for p in recipe.LORA_PROJECTIONS)
    peft_model, loss = recipe.train_phrase_lora(
        model,
        rf".*text_model\.layers\.\d+\.(self_attn|mlp)\.({projections})_proj",
        [image_batch, text_batch],
        TRAIN_STEPS,
    )
    recipe.save_phrase_adapter(peft_model, out, VISION_DEMO_MODEL_NAME, phrase, loss)


def build(out: Path) -> Path:
    """Build the vision demo into ``out`` unless it is already current; returns ``out``."""
    return recipe.build_once(out, recipe_hash(), "vision demo model and adapter", _build)


def _build(tmp: Path) -> None:
    import torch

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    base = tmp / BASE_DIRNAME
    phrases = [adapter.phrase for adapter in VISION_ADAPTERS]
    tokenizer = recipe.train_tokenizer(
        recipe.corpus(WORDS, phrases, SEED), SPECIAL_TOKENS, CHAT_TEMPLATE
    )
    processor = _build_processor(tokenizer)
    processor.save_pretrained(base)
    _build_base(base, tokenizer)
    for adapter in VISION_ADAPTERS:
        _train_adapter(base, processor, adapter.phrase, tmp / "adapters" / adapter.name)
    _demo_images(tmp / "images")


def main(argv: list[str]) -> int:
    """``[OUT_DIR] [--serve-args]``: build; then print how to serve it, or (``--serve-args``)
    the ``gateway serve`` arguments alone, NUL-separated, for scripts."""
    serve_args = "--serve-args" in argv
    paths = [arg for arg in argv if arg != "--serve-args"]
    out = (Path(paths[0]) if paths else default_vision_demo_dir()).expanduser().resolve()
    with contextlib.redirect_stdout(sys.stderr) if serve_args else contextlib.nullcontext():
        build(out)
    if serve_args:
        sys.stdout.write("\0".join(vision_serve_args(out)) + "\0")
    else:
        print("Serve it with:\n  gateway serve " + shlex.join(vision_serve_args(out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
