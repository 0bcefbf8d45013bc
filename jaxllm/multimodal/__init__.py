"""Images in (issue 65): the image processor, and what the engine needs of a request's images."""
