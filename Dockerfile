# Baton's image: the CLI and every service (`baton service <name>`), CPU torch.
#
#   docker build -t baton:dev .
#   docker run --rm baton:dev --help
#
# CPU torch is installed first, from PyTorch's CPU index: a plain `pip install .` would pull
# several GB of CUDA wheels. For GPU trainers build with a CUDA index, e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124 .
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN pip install torch --index-url "${TORCH_INDEX_URL}"

# Only what `pip install .` needs (see [tool.setuptools.packages.find] in pyproject.toml);
# tests, docs, deploy/ and any generated certificate stay out of the image.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY baton ./baton
COPY services ./services
COPY shared ./shared
COPY examples ./examples
RUN pip install . && rm -rf /src

# Non-root. A trainer's scratch (BATON_WORK_DIR, default ./.baton/work) lives under the
# working directory, which this user owns.
RUN useradd --create-home --home-dir /home/baton --uid 10001 --user-group baton \
    && mkdir -p /var/lib/baton && chown baton:baton /var/lib/baton
USER baton
WORKDIR /var/lib/baton

ENTRYPOINT ["baton"]
CMD ["--help"]
