"""pytest plugin: with INVACT_PATCH=1, run invact.patch() on every transformers model the tests build.

Load it with `-p benchmarks.hf_model_tests.plugin` (the repository root on sys.path). It wraps
`transformers.PreTrainedModel.post_init`, which every model's __init__ ends with, so that models
built by from_pretrained (inside its meta-device context) and sub-models are patched as well;
patch() is idempotent, so a sub-model patched first and its parent patched later is fine. Without
INVACT_PATCH=1 the plugin does nothing, so a plain run and a patched run differ in that variable only.
"""

import functools
import os


def pytest_configure(config):
    if os.environ.get("INVACT_PATCH") != "1":
        return
    from transformers import PreTrainedModel

    import invact

    original = PreTrainedModel.post_init
    if getattr(original, "_invact_wrapped", False):
        return

    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        invact.patch(self)
        return result

    post_init._invact_wrapped = True
    PreTrainedModel.post_init = post_init


def pytest_report_header(config):
    if os.environ.get("INVACT_PATCH") == "1":
        import invact

        return f"invact: patching every PreTrainedModel in post_init ({os.path.dirname(invact.__file__)})"
