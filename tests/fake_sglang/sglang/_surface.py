"""Names the fake exports only because veRL imports them (see tests/fake_sglang/README.md)."""


class NotInFakeSGLang(RuntimeError):
    pass


def import_surface_only(name: str):
    def call(*args, **kwargs):
        raise NotInFakeSGLang(f"{name} exists in the fake SGLang only because veRL imports it; final never calls it "
                              f"(in-process Engine, tp=1)")

    call.__name__ = name.rsplit(".", 1)[-1]
    return call
