# CPU image for the docker-compose simulation of several machines (see docker-compose.yaml).
# Each container is one "node": it runs ./entrypoint.sh, which starts torchrun with
# c10d rendezvous at node0.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /workspace

# Dependencies first, so editing the code does not reinstall torch. The CPU wheels keep
# the image around 1 GB instead of several with CUDA.
COPY requirements.txt ./
RUN grep -E '^(torch|torchvision)' requirements.txt > /tmp/torch.txt \
 && pip install --index-url https://download.pytorch.org/whl/cpu -r /tmp/torch.txt \
 && grep -vE '^(torch|torchvision|-e )' requirements.txt > /tmp/rest.txt \
 && pip install -r /tmp/rest.txt

COPY . .
RUN pip install --no-deps -e .

ENTRYPOINT ["./entrypoint.sh"]
