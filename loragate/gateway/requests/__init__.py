"""What a request must be before it reaches a backend, one module per part of it.

``chat`` brings a chat request to OpenAI's shape (``vi`` for Datature Vi's flat one,
``structured_outputs`` for response formats, ``vision_model`` for whether images are
required); ``media`` checks its images (``image_fetch``, ``media_files``,
``media_pools``, ``image_limits``); ``parameters`` checks the generation
parameters; ``responses`` checks a Responses API request.

Nothing is imported here: the routes import the module they need, and the hot path pays
for nothing else.
"""
