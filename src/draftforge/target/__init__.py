"""`target` stage: resolve a target spec to a loadable HF folder and describe it in target.json."""
