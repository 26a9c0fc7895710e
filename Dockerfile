# GPU worker image: SGLang's own image plus the fleet.
FROM lmsysorg/sglang:v0.5.11
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir -e .
