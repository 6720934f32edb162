"""The Anthropic Messages API on the OpenAI server's app (DESIGN.md §10: one internal chat
request, several wire formats): routes.py (anthropic_router), the request body
(messages_request.py), its conversion (chat_request.py), the reply (message_tracker.py,
content_blocks.py, message_stream.py) and the errors (errors.py).

Nothing is imported here: the OpenAI app imports routes.py and errors.py while the
OpenAI package itself is still being imported."""
