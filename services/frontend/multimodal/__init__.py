"""Images in a request, from what a client names to the engine's ImageInputs.

media_loader.py: an image_url (data URL, allowed local file, allowed http(s) host) -> bytes
under the operator's bounds; image_decoder.py: bytes -> an RGB PIL image (allow-listed
formats, pixels checked before decoding); image_processor.py: the model's HF processor,
which expands each image marker and makes the pixel tensors (one ImageInput per image);
chat_images.py: a conversation's image parts, in every API's shape; image_loader.py: all of
a request's images loaded and decoded within --limit-mm-per-prompt; image_prompt.py: a
rendered prompt and its images to token ids and ImageInputs, off the event loop.
"""
