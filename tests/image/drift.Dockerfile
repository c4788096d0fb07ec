# Test-only: a base image whose SGLang lost a capture point, as an upstream refactor would
# (LlamaForCausalLM.set_eagle3_layers_to_capture renamed). Building the real Dockerfile FROM
# it must fail in `hsdump doctor`.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN models="$(python3 -c 'import importlib.util as u; print(u.find_spec("sglang").submodule_search_locations[0])')/srt/models" \
    && sed -i 's/def set_eagle3_layers_to_capture/def set_aux_layers_to_capture/' "$models/llama.py" \
    && grep -q 'def set_aux_layers_to_capture' "$models/llama.py"
