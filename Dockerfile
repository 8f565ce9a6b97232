# One image for the control plane and the agents (`hybridtrain server` / `hybridtrain agent`).
# torch comes from PyPI with its CUDA libraries, so the same image trains on NVIDIA GPUs when
# the container is given them (see docker-compose.yml), and on CPU otherwise.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/hybridtrain

# Dependencies first, so code edits do not reinstall torch; setuptools too, with which the
# control plane builds the agents' wheel (GET /dist/) from this tree.
COPY pyproject.toml README.md ./
RUN mkdir -p app agents trainer hybridtrain testbed \
    && touch app/__init__.py agents/__init__.py trainer/__init__.py hybridtrain/__init__.py testbed/__init__.py \
    && pip install '.[server,agent]' && pip uninstall -y hybridtrain \
    && pip install setuptools==84.2.1

COPY app ./app
COPY agents ./agents
COPY trainer ./trainer
COPY hybridtrain ./hybridtrain
COPY testbed ./testbed
COPY migrations ./migrations
COPY alembic.ini ./
COPY static ./static
COPY templates ./templates
RUN pip install --no-deps -e .

# Roles run as an unprivileged user; the state dir holds the agent's token.
RUN useradd --create-home --uid 1000 hybridtrain && mkdir -p /var/lib/hybridtrain \
    && chown hybridtrain /var/lib/hybridtrain /opt/hybridtrain
USER hybridtrain
ENTRYPOINT ["hybridtrain"]
CMD ["server", "--host", "0.0.0.0", "--port", "8000"]
