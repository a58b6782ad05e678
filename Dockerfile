# One image, two variants:
#   docker build -t distlab:cpu .                                  # CPU wheels (~1 GB): docker-compose
#   docker build --build-arg VARIANT=gpu -t distlab:gpu .          # CUDA wheels: Kubernetes, SLURM (pyxis)
# The CUDA torch wheels carry the CUDA runtime themselves; a GPU host needs only the
# NVIDIA driver and container toolkit (docker run --gpus all / the k8s device plugin).
# Each container is one "node": ./entrypoint.sh starts torchrun with c10d rendezvous.
ARG PYTHON=3.11
FROM python:${PYTHON}-slim

# cpu -> https://download.pytorch.org/whl/cpu; gpu -> the CUDA 13.0 wheels (driver >= 580)
ARG VARIANT=cpu
ARG CUDA_INDEX=https://download.pytorch.org/whl/cu130
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 DISTLAB_IMAGE_VARIANT=${VARIANT}
WORKDIR /workspace

# Dependencies first, so editing the code does not reinstall torch.
COPY requirements.txt ./
RUN case "$VARIANT" in \
      cpu) index=https://download.pytorch.org/whl/cpu ;; \
      gpu) index="$CUDA_INDEX" ;; \
      *) echo "VARIANT must be cpu or gpu, not '$VARIANT'" >&2; exit 2 ;; \
    esac \
 && grep -E '^(torch|torchvision)' requirements.txt > /tmp/torch.txt \
 && pip install --index-url "$index" -r /tmp/torch.txt \
 && grep -vE '^(torch|torchvision|-e )' requirements.txt > /tmp/rest.txt \
 && pip install -r /tmp/rest.txt

COPY . .
RUN pip install --no-deps -e .

ENTRYPOINT ["./entrypoint.sh"]
