"""`final serve`: Tokasaurus' HTTP protocol (OpenAI completions + the cartridge endpoints) on InferenceEngine.

Kept import-free (the protocol itself is final.protocol, usable without FastAPI);
the app lives in final.server.app (create_app, ServerThread).
"""
