# The mobizo image: the server (`mobizo server`) and, with another command, a device agent (`mobizo agent run`).
# CPU-only PyTorch: export and replay need no GPU.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

COPY pyproject.toml README.md ./
COPY mobizo ./mobizo
COPY shared ./shared
COPY server ./server
COPY device_agent ./device_agent
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu ".[all]" \
    && useradd --create-home --uid 1000 mobizo \
    && mkdir -p /data /agent && chown mobizo /data /agent

USER mobizo
ENV MOBIZO_DATA_DIR=/data
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz')"
CMD ["mobizo", "server", "--host", "0.0.0.0", "--port", "8000"]
