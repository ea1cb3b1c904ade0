"""The README's configuration reference must name every configuration key the code accepts."""

from pathlib import Path

from pydantic import BaseModel

from cri_resmgr.config import Config

README = Path(__file__).resolve().parent.parent / "README.md"


def leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += leaf_keys(ann, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def test_readme_documents_every_config_key():
    text = README.read_text()
    missing = [k for k in leaf_keys(Config) if f"`{k}`" not in text]
    assert not missing, f"README configuration reference lacks: {missing}"


def test_readme_names_the_commands_ci_uses():
    text = README.read_text()
    assert "make run" in text and "make test" in text
    assert "make test" in (README.parent / ".ci" / "run").read_text()
