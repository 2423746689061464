# The mobizo image: the server (`mobizo server`), a worker (`mobizo worker`) and, with another command, a device
# agent (`mobizo agent run`). CPU-only PyTorch: export and replay need no GPU.
# BASE: python:3.11-slim; scripts/compose.sh passes a Debian bookworm root of its own (Python 3.11 in a venv at
# /usr/local, where the slim image has its Python), and a wheelhouse through PIP_FIND_LINKS with PIP_NO_INDEX=1.
ARG BASE=python:3.11-slim
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG EXTRAS=all

# The dependencies first, in a layer that changes only with pyproject.toml (empty packages stand in for the code)
COPY pyproject.toml README.md ./
RUN mkdir mobizo shared server device_agent \
    && touch mobizo/__init__.py shared/__init__.py server/__init__.py device_agent/__init__.py \
    && pip install --extra-index-url https://download.pytorch.org/whl/cpu ".[${EXTRAS}]" \
    && pip uninstall -y mobizo && rm -rf mobizo shared server device_agent build ./*.egg-info

COPY mobizo ./mobizo
COPY shared ./shared
COPY server ./server
COPY device_agent ./device_agent
RUN pip install --no-deps . && rm -rf build ./*.egg-info \
    && useradd --create-home --uid 1000 mobizo \
    && mkdir -p /data /agent && chown mobizo /data /agent

USER mobizo
ENV MOBIZO_DATA_DIR=/data
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz')"
CMD ["mobizo", "server", "--host", "0.0.0.0", "--port", "8000"]
