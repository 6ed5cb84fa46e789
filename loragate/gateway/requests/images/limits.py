"""The 4xx an image gets, and what the images of one request may add up to."""

from __future__ import annotations

from loragate.gateway.errors import OpenAIError


def image_error(param: str, message: str, code: str = "invalid_image") -> OpenAIError:
    """A 400 for the image at ``param``; ``message`` is a sentence without its capital and stop."""
    return OpenAIError(400, message[0].upper() + message[1:] + ".", param=param, code=code)


def image_too_large(param: str, max_bytes: int) -> OpenAIError:
    return image_error(
        param, f"the image is larger than {max_bytes} bytes (--max-image-bytes)", "image_too_large"
    )


class ImageBudget:
    """What the images of one request may add to the body the engine gets: its body cap, as if
    every image had come inline. A short request naming 16 URLs (or local files) must not make
    the gateway hold and send 16 times --max-image-bytes."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.left = total

    def take(self, uri: str, param: str) -> str:
        self.left -= len(uri)
        if self.left < 0:
            raise self.exceeded(param)
        return uri

    def exceeded(self, param: str) -> OpenAIError:
        return image_error(
            param,
            f"the images of this request add up to more than {self.total} bytes as data URIs "
            "(--max-body-bytes)",
            "images_too_large",
        )
