# kvgate image: dependencies and the wheel are installed into a venv in a builder stage; the runtime stage
# copies only that venv onto a clean python:3.11-slim and runs as an unprivileged numeric user.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# A venv without pip of its own: the base image's pip installs into it, so nothing to build with ships.
RUN python -m venv --without-pip /opt/venv
# Dependencies first, from pyproject.toml alone, so code changes reuse this layer.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip --python /opt/venv/bin/python install -r /tmp/requirements.txt
COPY README.md ./
COPY kvgate ./kvgate
RUN pip wheel --no-deps --wheel-dir /tmp/wheels . \
    && pip --python /opt/venv/bin/python install --no-deps /tmp/wheels/*.whl

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY --from=builder /opt/venv /opt/venv
# Numeric, so Kubernetes can verify runAsNonRoot without reading /etc/passwd.
USER 10001:10001
EXPOSE 8080 9090 9002
ENTRYPOINT ["kvgate"]
CMD ["serve"]
