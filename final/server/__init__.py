"""`final serve`: Tokasaurus' HTTP protocol (OpenAI completions + the cartridge endpoints) on InferenceEngine.

Kept import-free so `final.server.fingerprint` can be used by clients without FastAPI installed;
the app lives in final.server.app (create_app, ServerThread).
"""
