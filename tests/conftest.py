"""Every process a test starts leaves the OpenAI HTTP face off (its default port, 8000, would
be shared by all of them) unless the test asks for it with --http-port."""

import os

os.environ.setdefault("KVSERVE_HTTP_PORT", "0")
